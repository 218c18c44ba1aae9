"""A server process miles owns (an engine server, sglang-router): started in its own process group with its
output in a log file, waited on until it is ready (failing at once when it dies, or at the deadline, with the end
of its log), and stopped by a signal to its whole group.

`EngineProcess` (`miles.engines.sglang_engine`) and `Router` (`miles.engines.router`) are managed servers; each
builds its own command line and says when it is ready.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import IO

from miles.utils.engine_control_http import EngineCallError

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25


class EngineStartupError(RuntimeError):
    """The server process died or did not become ready in time."""


class ManagedServer(ABC):
    """The process side of a server miles launches: `start`, `wait_until`, `log_tail`, `stop`.

    A subclass sets `server_name` (how messages name it) and `log_prefix`, and provides `url`."""

    server_name = "server"
    log_prefix = "miles-server"

    def __init__(self, log_path: str | None) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log_file: IO[bytes] | None = None

    @property
    @abstractmethod
    def url(self) -> str:
        """The server's base URL (for messages)."""

    def start(self, command: list[str], port: int, env: dict[str, str] | None = None) -> None:
        """Run `command` in a new process group, its stdout and stderr appended to `log_path` (a new temporary
        file `{log_prefix}-{port}-*.log` when none was given). The log is readable by its owner only: SGLang
        logs its `server_args`, keys included."""
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"{self.log_prefix}-{port}-", suffix=".log")
            os.close(fd)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # an existing log (a restarted engine appends) too
        self._log_file = os.fdopen(fd, "ab")
        logger.info("launching %s: %s (log: %s)", self.server_name, " ".join(command), self.log_path)
        self.proc = subprocess.Popen(
            command, stdout=self._log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def log_tail(self, n_chars: int = 4000) -> str:
        """The end of the server's log."""
        if not self.log_path or not os.path.exists(self.log_path):
            return "<no log>"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - n_chars))
            return f.read().decode(errors="replace")

    def wait_until(self, ready: Callable[[], bool], deadline: float, phase: str) -> None:
        """Poll `ready()` (an HTTP failure counts as not ready) until it holds; EngineStartupError naming `phase`
        and carrying the log tail when the process exits first or `deadline` (time.monotonic) passes."""
        started = time.monotonic()
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineStartupError(
                    f"{self.server_name} process exited with code {self.proc.returncode} while starting "
                    f"(phase: {phase}). Log tail:\n{self.log_tail()}"
                )
            try:
                if ready():
                    return
            except EngineCallError:
                pass
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"{self.server_name} at {self.url} not ready after {time.monotonic() - started:.0f} s "
                    f"(phase: {phase}). Log tail:\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL_S)

    def stop(self, signal_first: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Send `signal_first` to the server's process group and reap it, SIGKILL when it lingers past
        `timeout`; a server that already died gets its group killed (what it left behind)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal_first)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s %s ignored signal %d for %.0f s; killing",
                    self.server_name,
                    self.url,
                    signal_first,
                    timeout,
                )
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        elif proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
