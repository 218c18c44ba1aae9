"""The embedded engine served from threads of the calling process instead of a `python -m miles.engines.local`
process of its own: a CPU training rank hosts its colocated engine this way (`TrainWorker.launch_engine`), which
saves the engine's own interpreter, imports and Ray actor (~400 MB and ~5 s of CPU per engine at start-up).

The engine is the same `LocalEngine` behind the same HTTP app (`miles.engines.local.server.create_app`) on its own
loopback port, built from the same flags (`miles.engines.local.__main__.parse_args`); only its process changes.
What the host process keeps to itself:
- torch's intra-op thread count: the engine's scheduler thread, which runs every forward and admin operation, sets
  its own (`--num-threads`); the host's threads keep theirs, and threads started later get the host's default;
- torch's global random state: building the engine draws nothing from the host's generator (its sampling draws
  from per-request generators);
- logging: uvicorn configures no logging; the engine's `miles.engines.local` loggers write to `log_path` when
  given (the engine's log file, as a separate engine's output would go there).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles.engines.sglang_args import flag_args
from miles.utils.engine_control_http import health_problem, serve_here, unserve_here
from miles.utils.net import free_port, node_ip

if TYPE_CHECKING:
    import uvicorn

    from miles.engines.local.engine import LocalEngine
    from miles.utils.types import JSON

logger = logging.getLogger(__name__)

_ENGINE_LOGGER = "miles.engines.local"


def set_thread_count(engine: LocalEngine, num_threads: int, timeout: float = 60.0) -> None:
    """Give the engine's scheduler thread `num_threads` intra-op threads, leaving this thread's count and the
    default of threads started later as they were. torch's count is per OS thread once a thread has used it, and
    a thread that has not yet takes the process default (the last value set by any thread): so this thread's count
    is fixed first, the scheduler thread's set, then the default put back."""
    import torch

    before = torch.get_num_threads()  # fixes this thread's count (torch initialises it on first use)

    def on_scheduler() -> int:
        torch.get_num_threads()  # fix the scheduler thread's count first, or its first use resets it
        torch.set_num_threads(num_threads)
        return torch.get_num_threads()

    got = engine.scheduler.call(on_scheduler).result(timeout)
    torch.set_num_threads(before)  # the process default again (and this thread's, unchanged)
    assert got == num_threads, (got, num_threads)


class InProcessEngine:
    """One embedded engine served from this process: `launch` builds it and starts its HTTP server on a daemon
    thread, `shutdown` stops both. `local_args` are `python -m miles.engines.local`'s flags by name."""

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        local_args: Mapping[str, object] | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        log_path: str | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.local_args = dict(local_args or {})
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.engine: LocalEngine | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._log_handler: logging.Handler | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("engine not launched yet: no port")
        host = node_ip() if self.host in ("0.0.0.0", "::", "") else self.host  # as `EngineProcess.url`
        return f"http://{host}:{self.port}"

    def launch(self) -> InProcessEngine:
        """Build the engine, start its scheduler and HTTP server, wait for /health; returns self."""
        if self.engine is not None:
            raise RuntimeError(f"engine already launched at {self.url}")
        if self.port is None:
            self.port = free_port(self.host if self.host != "0.0.0.0" else "127.0.0.1")
        try:
            self._start(self.port)
        except BaseException:
            self.shutdown()  # do not leave a half-started server behind
            raise
        serve_here(self.url, self.admin_call)  # the refit's window load in this process calls it directly
        return self

    def _start(self, port: int) -> None:
        from miles.utils.lazy_import import gc_paused

        with gc_paused():  # the server's imports (fastapi, pydantic): no collection walks the host's objects
            import torch
            import uvicorn

            from miles.engines.local.__main__ import engine_config, parse_args
            from miles.engines.local.engine import LocalEngine
            from miles.engines.local.server import create_app

        # no malloc_trim after a release: it would return the host rank's freed activations too, which its next
        # step faults in again (quickstart: ~25 ms a step; the peak memory was the same with and without)
        argv = [
            f"--model-path={self.model_path}",
            f"--host={self.host}",
            f"--port={port}",
            "--no-trim-after-release",
        ]
        args = parse_args(argv + flag_args(self.local_args))
        self._attach_log()
        with torch.random.fork_rng(devices=[]):  # the host's random state stays as it was
            self.engine = LocalEngine(engine_config(args))
        self.engine.start()
        if args.num_threads:
            set_thread_count(self.engine, args.num_threads)
        app = create_app(
            self.engine,
            args.host,
            port,
            self.api_key,
            args.request_timeout,
            admin_api_key=self.admin_api_key,
        )
        config = uvicorn.Config(app, host=self.host, port=port, log_level="warning", log_config=None)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="miles-local-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while health_problem(self.url) is not None:
            if not self._thread.is_alive():
                raise RuntimeError(f"embedded engine at {self.url}: its HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"embedded engine at {self.url}: no /health within {self.startup_timeout} s"
                )
            time.sleep(0.05)
        logger.info("embedded engine serving %s on %s in this process", self.model_path, self.url)

    def _attach_log(self) -> None:
        if self.log_path is None or self._log_handler is not None:
            return
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s"))
        engine_logger = logging.getLogger(_ENGINE_LOGGER)
        engine_logger.addHandler(handler)
        if engine_logger.level == logging.NOTSET:
            engine_logger.setLevel(logging.INFO)
        self._log_handler = handler

    def release_memory(self, tags: list[str], timeout: float) -> None:
        """`/release_memory_occupation` of `tags` called directly, for the process serving the engine (no HTTP
        round trip); raises what the endpoint answers as an error (`RefitRefused` when busy)."""
        if self.engine is None:
            raise RuntimeError(f"the engine at {self.url} is not running")
        self.engine.run("release_memory_occupation", tags=list(tags)).result(timeout)

    def admin_call(self, op: str, body: Mapping[str, Any], timeout: float) -> dict[str, JSON]:
        """Admin operation `op` (its endpoint's JSON `body`) called directly, for the process serving the engine
        (no HTTP round trip: the client's and the server's CPU in this same process): the answer as the endpoint
        sends it (through JSON), which must report success; raises what the endpoint answers as an error."""
        if self.engine is None:
            raise RuntimeError(f"the engine at {self.url} is not running")
        reply = self.engine.run(op, **body).result(timeout)
        answer = json.loads(json.dumps(reply, allow_nan=False))
        if not isinstance(answer, dict) or not answer.get("success", False):
            message = answer.get("message", answer) if isinstance(answer, dict) else answer
            raise RuntimeError(f"engine {self.url}, {op}: success=false: {message}")
        return answer

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the HTTP server, then the engine's scheduler (in-flight requests are aborted)."""
        if self.port is not None:
            unserve_here(self.url, self.admin_call)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.stop()
        self._server = self._thread = self.engine = None
        if self._log_handler is not None:
            logging.getLogger(_ENGINE_LOGGER).removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
