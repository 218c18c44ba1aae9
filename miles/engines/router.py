"""Start sglang-router (`python -m sglang_router.launch_router`) in front of rollout engine servers, or use a
running one (`--sglang-router-ip/--sglang-router-port`).

A launched router is a subprocess bound to 127.0.0.1 on a free port. Workers are registered at launch
(`--worker-urls`) or later with `add_worker`, which uses the router's REST API (`POST /workers`, checked with
`GET /workers`; sglang-router 0.3.x answers 404 on the older `/add_worker`). A running router (`Router.running`)
is never started or stopped: miles registers its engines with it and, at shutdown, unregisters the ones it added.

Where generation goes (`generation_via_router`): through the router when the run asks for a router policy or
names a running router; otherwise straight to the engines (see `miles.rollout.engine_client`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from miles.engines.sglang_engine import EngineStartupError
from miles.utils.net import free_port

logger = logging.getLogger(__name__)

DEFAULT_POLICY = "round_robin"  # the launched router's policy when --router-policy is not set


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


class Router:
    """One sglang-router process and a client for its worker-management API."""

    def __init__(
        self,
        worker_urls: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = DEFAULT_POLICY,
        extra_args: list[str] | None = None,
        log_path: str | None = None,
        startup_timeout: float = 60.0,
    ):
        """`extra_args` (sglang-router's own `--NAME VALUE` options) replace the settings miles would give the
        same options (`resilience_args`, metrics port, log level)."""
        from miles.engines.router_args import router_policies

        if policy not in router_policies():
            raise ValueError(f"router policy {policy!r} not supported; allowed: {list(router_policies())}")
        self.running = False
        self._added: list[str] = []  # workers this object registered with a running router
        self.worker_urls = list(worker_urls or [])
        self.host = host
        self.port = port
        self.policy = policy
        self.extra_args = list(extra_args or [])
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log_file: Any = None
        self._client = httpx.Client(timeout=30.0, trust_env=False)

    @classmethod
    def running_at(cls, host: str, port: int, timeout: float = 60.0) -> Router:
        """A client for the sglang-router already running at host:port (waits for its /health); miles never
        starts or stops it."""
        router = cls(host=host, port=port, startup_timeout=timeout)
        router.running = True
        router._wait(
            lambda: router._client.get(router.url + "/health", timeout=5).status_code == 200,
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
        if self.worker_urls:
            cmd += ["--worker-urls", *self.worker_urls]
        defaults = ["--prometheus-port", str(free_port(self.host)), "--prometheus-host", self.host]
        return cmd + merge_args(defaults + ["--log-level", "warn"], self.extra_args)

    def launch(self) -> Router:
        """Start the router and wait until it answers /health and lists every initial worker; returns self."""
        if self.proc is not None:
            raise RuntimeError(f"router already launched at {self.url}")
        if self.port is None:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"miles-router-{self.port}-", suffix=".log")
            os.close(fd)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process lifetime
        logger.info("launching sglang-router: %s (log: %s)", " ".join(self.command()), self.log_path)
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_started()
        except BaseException:
            self.shutdown()  # do not leave a half-started router behind
            raise
        return self

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        self._wait(
            lambda: self._client.get(self.url + "/health", timeout=5).status_code == 200, deadline, "/health"
        )
        for url in self.worker_urls:
            self._wait(lambda u=url: u in self.list_workers(), deadline, f"registration of worker {url}")

    def _log_tail(self, n_chars: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "<no log>"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - n_chars))
            return f.read().decode(errors="replace")

    def _wait(self, ready: Any, deadline: float, phase: str) -> None:
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineStartupError(
                    f"sglang-router exited with code {self.proc.returncode} (phase: {phase}). "
                    f"Log tail:\n{self._log_tail()}"
                )
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"sglang-router at {self.url} not ready (phase: {phase}) before the deadline. "
                    f"Log tail:\n{self._log_tail()}"
                )
            time.sleep(0.25)

    def list_workers(self) -> list[str]:
        """URLs of the workers the router knows."""
        resp = self._client.get(self.url + "/workers")
        resp.raise_for_status()
        return [w["url"] for w in resp.json().get("workers", [])]

    def add_worker(self, url: str, timeout: float = 60.0) -> None:
        """Register a worker and wait until the router lists it (registration is asynchronous)."""
        resp = self._client.post(self.url + "/workers", json={"url": url})
        if resp.status_code >= 400:
            raise RuntimeError(f"router refused worker {url}: HTTP {resp.status_code}: {resp.text[:500]}")
        self._wait(lambda: url in self.list_workers(), time.monotonic() + timeout, f"registration of {url}")

    def remove_worker(self, url: str, timeout: float = 60.0) -> None:
        """Unregister a worker and wait until the router no longer lists it (removal is asynchronous)."""
        resp = self._client.get(self.url + "/workers")
        resp.raise_for_status()
        ids = [w["id"] for w in resp.json().get("workers", []) if w["url"] == url]
        if not ids:
            raise ValueError(f"worker {url} not registered; known: {self.list_workers()}")
        for wid in ids:
            self._client.delete(f"{self.url}/workers/{wid}").raise_for_status()
        self._wait(lambda: url not in self.list_workers(), time.monotonic() + timeout, f"removal of {url}")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Terminate the router, then kill it if it lingers; a running router only loses the workers this
        object registered."""
        if self.running:
            added, self._added = self._added, []
            for url in added:
                try:
                    self.remove_worker(url, timeout)
                except (httpx.HTTPError, ValueError, EngineStartupError) as e:
                    logger.warning("could not unregister %s from the router %s: %s", url, self.url, e)
            return
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Router:
        return self.launch() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
