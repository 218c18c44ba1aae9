"""tests/unit is in-process: a unit test that starts a subprocess, a multiprocessing child, a listening socket
(a server) or a torch.distributed process group fails here and belongs in tests/integration."""

from __future__ import annotations

import multiprocessing.process
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest


def _refuse(what: str) -> Callable[..., None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"a unit test started {what}; tests/unit is in-process (no servers, subprocesses or process groups): "
            "move the test to tests/integration"
        )

    return refuse


@pytest.fixture(scope="session", autouse=True)
def _matplotlib_font_cache() -> None:
    """matplotlib builds its font cache on its first import on a machine (running `fc-list` in a subprocess):
    do that once before the guard below, so a unit test that draws is not refused on a fresh machine only."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _in_process_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a multiprocessing process"))
    monkeypatch.setattr(socket.socket, "listen", _refuse("a listening socket (a server)"))
    # torch is not imported here (config tests stay light): once a test module has imported torch.distributed,
    # creating a group raises; a test that imports it itself and leaves a group behind fails at teardown
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        monkeypatch.setattr(dist, "init_process_group", _refuse("a torch.distributed process group"))
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _refuse("a torch.distributed process group")()
