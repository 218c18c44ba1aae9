"""Start sglang-router (`python -m sglang_router.launch_router`) in front of rollout engine servers, or use a
running one (`--sglang-router-ip/--sglang-router-port`).

A launched router is a subprocess bound to 127.0.0.1 on a free port. Workers are registered at launch
(`--worker-urls`) or later with `add_worker`, which uses the router's REST API (`POST /workers`, checked with
`GET /workers`; sglang-router 0.3.x answers 404 on the older `/add_worker`). A running router (`Router.running`)
is never started or stopped: miles registers its engines with it and, at shutdown, unregisters the ones it added.

Engines that need a key (miles launches every engine with the run's key as SGLang's `--api-key` and
`--admin-api-key`, so that no endpoint but /health answers without it) are registered with that key in the
`POST /workers` body (`worker_api_key`): the router then sends it to the worker on every call (metadata discovery
from `/server_info` and `/model_info`, forwarded generation) and its own `GET /workers` does not show it. The key
never goes on the router's command line (`--api-key` would be readable in /proc, and makes the router demand it
on its own API).

Where generation goes (`generation_via_router`): through the router when the run asks for a router policy or
names a running router; otherwise straight to the engines (see `miles.rollout.generate_client`).
"""

from __future__ import annotations

import logging
import signal
import sys
import time

from miles.engines.managed_server import EngineStartupError, ManagedServer
from miles.utils.engine_control_http import EngineCallError, health_problem, request
from miles.utils.net import free_port

logger = logging.getLogger(__name__)

DEFAULT_POLICY = "round_robin"  # the launched router's policy when --router-policy is not set
CALL_TIMEOUT_S = 30.0  # one worker-management call


def generation_via_router(router_policy: str | None, running_router: bool) -> bool:
    """Whether rollout requests go through sglang-router: when a policy was asked for (`--router-policy`) or
    a running router was named (`--sglang-router-ip/--sglang-router-port`), else straight to the engines."""
    return router_policy is not None or running_router


def merge_args(defaults: list[str], overrides: list[str]) -> list[str]:
    """`defaults` without the options that `overrides` sets, then `overrides` (both `--flag [value ...]`)."""

    def split(args: list[str]) -> list[list[str]]:
        groups: list[list[str]] = []
        for token in args:
            if token.startswith("--") or not groups:
                groups.append([token])
            else:
                groups[-1].append(token)
        return groups

    given = {g[0] for g in split(overrides)}
    return [t for g in split(defaults) if g[0] not in given for t in g] + list(overrides)


def resilience_args(request_timeout: float) -> list[str]:
    """sglang-router settings under which a busy engine is not declared dead.

    Its circuit breaker opens after 10 failures in 120 s (a slow CPU engine's timeouts count) and then answers
    `503 No available workers` for 60 s, which once ended a healthy run: it is disabled, since dead engines are
    the health monitor's job (`--use-fault-tolerance`). Its own health check gets a generous timeout and is only
    consulted every 60 s; a request may take `request_timeout` seconds; retries back off for at most 2 s."""
    return [
        "--disable-circuit-breaker",
        "--health-check-timeout-secs", "30",
        "--health-failure-threshold", "3",
        "--request-timeout-secs", str(max(1, int(request_timeout))),
        "--retry-max-backoff-ms", "2000",
    ]  # fmt: skip


class Router(ManagedServer):
    """One sglang-router process (a `ManagedServer`) and a client for its worker-management API."""

    server_name = "sglang-router"
    log_prefix = "miles-router"

    def __init__(
        self,
        worker_urls: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = DEFAULT_POLICY,
        extra_args: list[str] | None = None,
        log_path: str | None = None,
        startup_timeout: float = 60.0,
        worker_api_key: str | None = None,
    ):
        """`extra_args` (sglang-router's own `--NAME VALUE` options) replace the settings miles would give the
        same options (`resilience_args`, metrics port, log level); `worker_api_key`: the key the workers take
        (see the module docstring)."""
        from miles.engines.router_args import router_policies

        if policy not in router_policies():
            raise ValueError(f"router policy {policy!r} not supported; allowed: {list(router_policies())}")
        super().__init__(log_path)
        self.running = False
        self._added: list[str] = []  # workers this object registered with a running router
        self.worker_urls = list(worker_urls or [])
        self.host = host
        self.port = port
        self.policy = policy
        self.extra_args = list(extra_args or [])
        self.startup_timeout = startup_timeout
        self.worker_api_key = worker_api_key

    @classmethod
    def running_at(
        cls, host: str, port: int, timeout: float = 60.0, worker_api_key: str | None = None
    ) -> Router:
        """A client for the sglang-router already running at host:port (waits for its /health); miles never
        starts or stops it."""
        router = cls(host=host, port=port, startup_timeout=timeout, worker_api_key=worker_api_key)
        router.running = True
        router.wait_until(
            lambda: health_problem(router.url) is None,
            time.monotonic() + timeout,
            "/health of the running router (--sglang-router-ip/--sglang-router-port)",
        )
        return router

    def register(self, urls: list[str], timeout: float = 60.0) -> None:
        """Register `urls` with a running router (those it lists already are left as they are)."""
        listed = self.list_workers()
        for url in urls:
            if url not in listed:
                self.add_worker(url, timeout)
                self._added.append(url)

    @property
    def url(self) -> str:
        """Base URL of the router."""
        if self.port is None:
            raise RuntimeError("router not launched yet: no port")
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The router command line (needs `port` set)."""
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        cmd += ["--policy", self.policy]
        if self.worker_urls and not self.worker_api_key:  # keyed workers are registered with their key
            cmd += ["--worker-urls", *self.worker_urls]
        defaults = ["--prometheus-port", str(free_port(self.host)), "--prometheus-host", self.host]
        return cmd + merge_args(defaults + ["--log-level", "warn"], self.extra_args)

    def launch(self) -> Router:
        """Start the router and wait until it answers /health and lists every initial worker; returns self."""
        if self.proc is not None:
            raise RuntimeError(f"router already launched at {self.url}")
        if self.port is None:
            self.port = free_port(self.host)
        self.start(self.command(), self.port)
        try:
            self._wait_started()
        except BaseException:
            self.shutdown()  # do not leave a half-started router behind
            raise
        return self

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        self.wait_until(lambda: health_problem(self.url) is None, deadline, "/health")
        if self.worker_api_key:
            for url in self.worker_urls:
                self._post_worker(url)
        for url in self.worker_urls:
            self.wait_until(lambda u=url: u in self.list_workers(), deadline, f"registration of worker {url}")

    def _workers(self) -> list[dict]:
        answer = request("GET", self.url, "workers", "listing workers", CALL_TIMEOUT_S, server="router")
        workers = answer.json_object().get("workers", [])
        if not isinstance(workers, list):
            raise RuntimeError(f"router {self.url}: GET /workers answered {workers!r}, not a worker list")
        return workers

    def list_workers(self) -> list[str]:
        """URLs of the workers the router knows."""
        return [w["url"] for w in self._workers()]

    def add_worker(self, url: str, timeout: float = 60.0) -> None:
        """Register a worker and wait until the router lists it (registration is asynchronous)."""
        self._post_worker(url)
        self.wait_until(
            lambda: url in self.list_workers(), time.monotonic() + timeout, f"registration of {url}"
        )

    def _post_worker(self, url: str) -> None:
        body = {"url": url, **({"api_key": self.worker_api_key} if self.worker_api_key else {})}
        request(
            "POST",
            self.url,
            "workers",
            f"registering worker {url}",
            CALL_TIMEOUT_S,
            body=body,
            server="router",
        )

    def remove_worker(self, url: str, timeout: float = 60.0) -> None:
        """Unregister a worker and wait until the router no longer lists it (removal is asynchronous)."""
        ids = [w["id"] for w in self._workers() if w["url"] == url]
        if not ids:
            raise ValueError(f"worker {url} not registered; known: {self.list_workers()}")
        for wid in ids:
            request(
                "DELETE",
                self.url,
                f"workers/{wid}",
                f"removing worker {url}",
                CALL_TIMEOUT_S,
                server="router",
            )
        self.wait_until(
            lambda: url not in self.list_workers(), time.monotonic() + timeout, f"removal of {url}"
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Terminate the router, then kill it if it lingers; a running router only loses the workers this
        object registered."""
        if self.running:
            added, self._added = self._added, []
            for url in added:
                try:
                    self.remove_worker(url, timeout)
                except (EngineCallError, ValueError, EngineStartupError) as e:
                    logger.warning("could not unregister %s from the router %s: %s", url, self.url, e)
            return
        self.stop(signal.SIGTERM, timeout)

    def __enter__(self) -> Router:
        return self.launch() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
