"""The managed-server base shared by the engine and router launchers, on tiny Python processes: a server that
dies while starting, one that never gets ready, and one that ignores SIGTERM."""

from __future__ import annotations

import sys
import time

import pytest

from miles.engines.managed_server import EngineStartupError, ManagedServer


class _Server(ManagedServer):
    server_name = "test server"
    log_prefix = "miles-test-server"

    @property
    def url(self) -> str:
        return "http://127.0.0.1:1"


def _start(tmp_path, code: str) -> _Server:
    server = _Server(str(tmp_path / "server.log"))
    server.start([sys.executable, "-c", code], port=1)
    return server


def test_a_server_that_dies_fails_at_once_with_its_log(tmp_path):
    server = _start(tmp_path, "import sys; print('model not found', flush=True); sys.exit(3)")
    with pytest.raises(EngineStartupError) as info:
        server.wait_until(lambda: False, time.monotonic() + 60, "waiting for /health")
    message = str(info.value)
    # the exit is noticed, not the 60 s deadline (that one would say "not ready after")
    assert "test server process exited with code 3 while starting (phase: waiting for /health)" in message
    assert "model not found" in message  # the log tail
    server.stop()
    assert server.proc is None


def test_a_late_server_names_the_phase_and_is_stopped(tmp_path):
    server = _start(tmp_path, "import time; time.sleep(60)")
    proc = server.proc
    with pytest.raises(EngineStartupError, match=r"test server at http://127.0.0.1:1 not ready after \d+ s "
                       r"\(phase: registration of worker x\)"):  # fmt: skip
        server.wait_until(lambda: False, time.monotonic() + 0.3, "registration of worker x")
    server.stop(timeout=10)
    assert proc is not None and proc.poll() is not None and server.proc is None


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    server = _start(tmp_path, code)
    proc = server.proc
    server.wait_until(lambda: "up" in server.log_tail(), time.monotonic() + 30, "startup")
    server.stop(timeout=0.5)
    assert proc is not None and proc.returncode == -9  # killed: not waited for until its sleep ended


def test_the_log_is_readable_by_its_owner_only(tmp_path):
    """SGLang logs its server_args, keys included: the log must not be readable by other local users."""
    import os
    import stat

    (tmp_path / "server.log").write_text("an earlier run\n")
    os.chmod(tmp_path / "server.log", 0o644)  # a restarted engine appends to its old log
    server = _start(tmp_path, "print('admin_api_key=s3cret', flush=True)")
    server.proc.wait(30)
    server.stop()
    assert stat.S_IMODE(os.stat(tmp_path / "server.log").st_mode) == 0o600
    assert "admin_api_key=s3cret" in (tmp_path / "server.log").read_text()
