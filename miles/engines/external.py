"""External engines (`--rollout-external-engine-addrs HOST:PORT ...`): servers miles uses but does not own.

An `ExternalEngine` has the interface the engine fleet uses for the engines it launches (`EngineProcess` behind
`RolloutEngineActor`: `launch`, `url`, `post`, `get`, `shutdown`, `kill`, `restart`, `pid`), with the owner's
rules: `launch` only waits until the running server answers `/health`, `shutdown` and `kill` leave it running,
and `restart` refuses, naming the engine as external (whoever started it restarts it). miles health-checks,
refits and generates with it like with its own engines.

Refit reaches an external engine by one of the trainer's two paths, and `refit_path_problems` says before the
trainers start when neither can: without GPUs the trainer hands tensors over through shared memory, which only
a process on the trainer's machine can map (so a CPU run needs every external engine on this machine); with GPUs
the weights go by NCCL broadcast to engines on any reachable host.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from miles.engines.sglang_engine import EngineActorMethods, EngineCalls, EngineStartupError
from miles.utils.engine_control_http import health_problem
from miles.utils.net import node_ip

logger = logging.getLogger(__name__)

FLAG = "--rollout-external-engine-addrs"


def engine_url(addr: str) -> str:
    """`HOST:PORT` (or `http://HOST:PORT`, `[v6]:PORT`) -> `http://HOST:PORT`; ValueError naming the address."""
    text = addr.strip()
    parsed = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise ValueError(f"{addr!r} is not HOST:PORT (e.g. 10.0.0.5:30000 or http://10.0.0.5:30000)")
    if parsed.path not in ("", "/") or parsed.query:
        raise ValueError(f"{addr!r}: give the server's HOST:PORT only, without a path")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{parsed.scheme}://{host}:{port}"


def is_on_this_machine(url: str) -> bool:
    """Whether the engine at `url` runs on this machine (loopback, or an address of this machine)."""
    host = urlsplit(url).hostname or ""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if ip.is_loopback:
        return True
    local = {node_ip()}
    try:
        local.update(i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return str(ip) in local


def refit_path_problems(urls: list[str], use_gpu: bool, actor_world_size: int, per_engine: int) -> list[str]:
    """Why the trainer could not refit these external engines (empty: it can), naming each engine."""
    if use_gpu:
        return []  # NCCL broadcast from training rank 0 (the disaggregated path) reaches any host
    problems = [
        f"external engine {url} is not on this machine: without GPUs the trainer refits through shared "
        "memory, which only a process on its machine can map, and the broadcast path needs GPUs (NCCL); "
        "run the engine here or train with GPUs"
        for url in urls
        if not is_on_this_machine(url)
    ]
    if len(urls) * per_engine > actor_world_size:
        problems.append(
            f"{len(urls)} external engine(s) * --rollout-num-gpus-per-engine={per_engine} need as many "
            f"training ranks to refit through shared memory, but the trainer has {actor_world_size}"
        )
    return problems


class ExternalEngine(EngineCalls):
    """A running engine server at `url` that miles uses, refits and health-checks but never starts or stops."""

    kind = "external"

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self._url = engine_url(url)
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.startup_timeout = startup_timeout

    @property
    def url(self) -> str:
        return self._url

    def launch(self) -> ExternalEngine:
        """Wait (at most `startup_timeout` s) until the engine answers /health; starts nothing."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            problem = health_problem(self.url)
            if problem is None:
                logger.info("external engine %s is up (miles does not own it)", self.url)
                return self
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"external engine {self.url} ({FLAG}) not healthy after {self.startup_timeout:.0f}s "
                    f"(phase: waiting for /health; last: {problem}); miles does not start external engines: "
                    "start it, or fix the address"
                )
            time.sleep(0.5)

    @property
    def pid(self) -> int | None:
        """None: the process is not miles's."""
        return None

    def shutdown(self, timeout: float = 15.0) -> None:
        """Leave the engine running (its owner stops it)."""
        logger.info("leaving external engine %s running", self.url)

    def kill(self, timeout: float = 15.0) -> None:
        """Leave the engine running (its owner stops it)."""

    def restart(self) -> ExternalEngine:
        raise RuntimeError(
            f"engine {self.url} is external ({FLAG}): miles did not launch it and does not restart it; "
            "restart it yourself and resume the run from its last checkpoint"
        )


@functools.cache
def make_external_engine_actor_class() -> Any:
    """The Ray actor class wrapping an `ExternalEngine`, with the methods of `RolloutEngineActor`."""
    import ray

    class ExternalEngineActor(EngineActorMethods):
        def __init__(self, **kwargs: Any) -> None:
            self.engine = ExternalEngine(**kwargs)  # type: ignore[assignment]  # same methods as EngineProcess

    return ray.remote(ExternalEngineActor)
