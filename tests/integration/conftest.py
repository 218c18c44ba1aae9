"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def two_tiny_engines(tmp_path):
    """Two embedded engines (real HTTP servers) serving a tiny model built under `tmp_path`: (model_dir, procs)."""
    from miles.engines.sglang_engine import EngineProcess
    from miles.tools.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "model", seed=0))
    procs = [EngineProcess(model_dir, kind="local", startup_timeout=120).launch() for _ in range(2)]
    try:
        yield model_dir, procs
    finally:
        for p in procs:
            p.shutdown()
