"""Stand-ins for modules a library imports at start-up but a miles process rarely or never uses.

Inside `deferred({name: functions})`, `import name` (for each name not imported yet, and installed) gives a
stand-in module instead of the real one; the first use of any of its attributes imports the real module and
answers from it. A name listed in `functions` is a function of the stand-in itself that imports the real module
when called, so `from name import function` inside the block stays lazy too. The stand-ins leave `sys.modules` when
the block ends, so a later `import name` is the real module; whoever bound a stand-in keeps it, and it keeps
forwarding to the real module. Uses: `miles.utils.transformers_import` (`scipy.optimize`, `trio`),
`miles.utils.httpx_import` (`trio`).

`gc_paused()`: no cyclic garbage collection inside the block. Importing torch and transformers' model code
allocates about a million objects that live as long as the process, and the collections their allocation triggers
walk them again and again: ~0.7-1 s of CPU in a training rank, for almost nothing collected (imports make few
cycles; what they make is collected at the first collection after the block, or kept with `freeze`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


class StandIn(types.ModuleType):
    """Stands in for a module not imported yet (see the module doc)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # what the import system probes (__path__, ...): a plain module has none
            raise AttributeError(name)
        return getattr(real(self.__name__), name)


def real(name: str) -> types.ModuleType:
    """The real module `name`: imported now if a stand-in holds its place (inside the block) or nothing does."""
    if isinstance(sys.modules.get(name), StandIn):
        del sys.modules[name]
    return importlib.import_module(name)


def _deferred_function(module: str, function: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(real(module), function)(*args, **kwargs)

    call.__name__ = call.__qualname__ = function
    call.__doc__ = f"`{module}.{function}`, imported when called."
    return call


def _installed(name: str) -> bool:
    """Whether module `name` can be imported, without importing it or (for a submodule) its packages."""
    top = name.partition(".")[0]
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def deferred(modules: Mapping[str, Sequence[str]]) -> Iterator[None]:
    """Imports inside this block see each module of `modules` (name -> its functions to defer) as a stand-in that
    imports the real one on first use; a module imported already, or not installed, is left as it is."""
    placed: dict[str, StandIn] = {}
    for name, functions in modules.items():
        if name in sys.modules or not _installed(name):
            continue
        stand_in = StandIn(name)
        for function in functions:
            setattr(stand_in, function, _deferred_function(name, function))
        sys.modules[name] = placed[name] = stand_in
    try:
        yield
    finally:
        for name, stand_in in placed.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]


@contextlib.contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """No cyclic garbage collection inside this block (see the module doc); as it was after it. `freeze`: then
    move every object tracked to the permanent generation (`gc.freeze`, as the driver does after start-up), so
    later collections do not walk what the imports made, which lives as long as the process anyway (the few
    cycles left unreachable by then are kept too)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()
