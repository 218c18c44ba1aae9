"""The embedded engine gives freed heap pages back to the OS after a memory release (`--trim-after-release`, on
by default), and not when told so: an engine served from a training rank's process (`InProcessEngine`) passes
`--no-trim-after-release`, since the trim would also return the rank's freed activations."""

from __future__ import annotations

import pytest

from miles.engines.local import control
from miles.engines.local.__main__ import engine_config, parse_args
from miles.engines.local.engine import LocalEngine
from miles.tools.tiny_model import build_word_model


@pytest.mark.parametrize(
    "flag, trims", [(None, 1), ("--trim-after-release", 1), ("--no-trim-after-release", 0)]
)
def test_release_trims_unless_told_not_to(tmp_path, monkeypatch, flag, trims):
    calls = []
    monkeypatch.setattr(control.host_memory, "trim", lambda: calls.append(1) or True)
    path = build_word_model(tmp_path)
    argv = [
        f"--model-path={path}",
        "--max-running-requests=2",
        "--max-total-tokens=40",
        "--no-cpu-decode-kernel",
    ] + ([flag] if flag else [])
    eng = LocalEngine(engine_config(parse_args(argv)))
    eng.start()
    try:
        eng.run("release_memory_occupation").result(30)
        assert len(calls) == trims
    finally:
        eng.stop()
