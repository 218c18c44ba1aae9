"""`miles.utils.lazy_import.deferred`: a module imported inside the block is a stand-in until first used, then the
real module answers; the stand-ins leave sys.modules; modules imported already or not installed are left alone."""

from __future__ import annotations

import sys
import textwrap

import pytest

from miles.utils.lazy_import import StandIn, deferred


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """An installed module `miles_lazy_fake` that counts its imports in `sys.miles_lazy_fake_imports`."""
    (tmp_path / "miles_lazy_fake.py").write_text(
        textwrap.dedent(
            """
            import sys
            sys.miles_lazy_fake_imports = getattr(sys, "miles_lazy_fake_imports", 0) + 1
            VALUE = 7
            def double(x):
                return 2 * x
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "miles_lazy_fake", raising=False)
    monkeypatch.setattr(sys, "miles_lazy_fake_imports", 0, raising=False)
    yield "miles_lazy_fake"
    sys.modules.pop("miles_lazy_fake", None)


def test_stand_in_until_first_use_then_the_real_module(fake_module):
    with deferred({fake_module: ("double",)}):
        import miles_lazy_fake
        from miles_lazy_fake import double

        assert isinstance(miles_lazy_fake, StandIn)
        assert sys.miles_lazy_fake_imports == 0
    assert fake_module not in sys.modules  # the stand-in left with the block
    assert double(4) == 8  # a deferred function imports the real module when called
    assert sys.miles_lazy_fake_imports == 1
    assert miles_lazy_fake.VALUE == 7  # the stand-in forwards to the real module, imported once
    assert sys.miles_lazy_fake_imports == 1
    assert not isinstance(sys.modules[fake_module], StandIn)


def test_other_names_import_the_real_module_at_once(fake_module):
    with deferred({fake_module: ()}):
        from miles_lazy_fake import VALUE

        assert VALUE == 7
        assert sys.miles_lazy_fake_imports == 1
        assert not isinstance(sys.modules[fake_module], StandIn)  # the real module took the stand-in's place


def test_imported_or_missing_modules_are_left_alone(fake_module):
    import miles_lazy_fake

    with deferred({fake_module: (), "miles_no_such_module": ()}):
        assert sys.modules[fake_module] is miles_lazy_fake
        with pytest.raises(ImportError):
            import miles_no_such_module  # noqa: F401


def test_gc_paused_inside_and_restored_after():
    import gc

    from miles.utils.lazy_import import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the outer block re-enables
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    frozen = gc.get_freeze_count()  # an earlier test of this process may have frozen (a trainer's import)
    gc.disable()
    try:
        with gc_paused(freeze=True):  # off before: left off, nothing frozen
            pass
        assert not gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.enable()


def test_gc_paused_with_freeze_moves_what_exists_out_of_collections():
    import gc

    from miles.utils.lazy_import import gc_paused

    frozen = gc.get_freeze_count()
    try:
        with gc_paused(freeze=True):
            made = [[i] for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.unfreeze()
