"""Engine health monitor (`--use-fault-tolerance`): finds an engine that stopped answering and restarts it.

While a rollout runs, every `interval` seconds each engine's `GET /health_generate` must answer 200 within
`timeout` seconds (after `first_wait` seconds from the start of the rollout). An engine that fails is taken out of
the router, killed and restarted on the same bundle and port; it then waits in `restarted` until the driver refits
it with the current weights and version and `EngineFleet.readmit` puts it back behind the router. Its in-flight
requests fail when it is killed and the generate client retries them on the engines that remain (the client
reads the router's worker list, so a restarted engine gets no request before its refit and readmission).

A plain class with one thread, driven by callables, so tests exercise it without Ray or servers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthSettings:
    """--rollout-health-check-{interval,timeout,first-wait} in seconds."""

    interval: float
    timeout: float
    first_wait: float


@dataclass(frozen=True)
class Recovery:
    """One engine restart: which engine, why, and how long the restart took."""

    url: str
    reason: str
    seconds: float


class HealthMonitor:
    """Checks engines while watching; recovers a failed one with `take_out(url)`, then `restart(url)`.

    `check(url, timeout) -> str | None` returns why the engine is unhealthy (None: healthy).
    """

    def __init__(
        self,
        urls: list[str],
        settings: HealthSettings,
        check: Callable[[str, float], str | None],
        take_out: Callable[[str], None],
        restart: Callable[[str], None],
    ) -> None:
        self.urls = list(urls)
        self.settings = settings
        self._check, self._take_out, self._restart = check, take_out, restart
        self._lock = threading.Lock()
        self._watching_since: float | None = None
        self._recovering: str | None = None
        self._restarted: list[str] = []  # restarted, waiting for a refit
        self._failed: dict[str, str] = {}  # url -> why it could not be restarted
        self.recoveries: list[Recovery] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-health", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ driver side
    def start_watch(self) -> None:
        """Begin checking (a rollout started)."""
        with self._lock:
            self._watching_since = time.monotonic()

    def stop_watch(self, timeout: float) -> list[str]:
        """Stop checking, wait (at most `timeout` s) for a restart in progress, then check every engine once more
        and recover a failed one now; returns `take_restarted()`.

        The last check matters because the generate client sends around a dead engine at once: a rollout can end
        before the periodic check saw the engine die, and the refit that follows must not meet a dead engine."""
        with self._lock:
            self._watching_since = None
        deadline = time.monotonic() + timeout
        while self.recovering is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine restart: {self.recovering} not back within {timeout:.0f}s (phase: end of rollout)"
                )
            time.sleep(0.1)
        for url in self.urls:
            with self._lock:
                skip = url in self._restarted or url in self._failed
            why = None if skip else self._check(url, self.settings.timeout)
            if why is not None:
                self._recover(url, why)
        return self.take_restarted()

    def recover_now(self, check: Callable[[str, float], str | None]) -> list[str]:
        """Outside a watch (the engines paused for a refit, when `/health_generate` cannot answer): check every
        engine with `check` (liveness) and recover one that fails now; returns `take_restarted()`."""
        for url in self.urls:
            with self._lock:
                skip = url in self._restarted or url in self._failed
            why = None if skip else check(url, self.settings.timeout)
            if why is not None:
                self._recover(url, why)
        return self.take_restarted()

    def take_restarted(self) -> list[str]:
        """Engines restarted since the last call; raises if a restart failed (naming the engine and why)."""
        with self._lock:
            if self._failed:
                url, why = next(iter(self._failed.items()))
                raise RuntimeError(f"engine restart: {url} could not be restarted: {why}")
            out, self._restarted = self._restarted, []
            return out

    def done(self, url: str) -> None:
        """The driver refit `url` and it is back behind the router: check it again."""
        with self._lock:
            if url in self._restarted:
                self._restarted.remove(url)

    @property
    def recovering(self) -> str | None:
        with self._lock:
            return self._recovering

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------------------------------ thread
    def _watching(self) -> bool:
        with self._lock:
            since = self._watching_since
        return since is not None and time.monotonic() - since >= self.settings.first_wait

    def _loop(self) -> None:
        while not self._closed.is_set():
            if not self._watching():
                self._closed.wait(0.1)
                continue
            started = time.monotonic()
            for url in self.urls:
                with self._lock:
                    skip = url in self._restarted or url in self._failed
                if skip or not self._watching():
                    continue
                why = self._check(url, self.settings.timeout)
                if why is not None and self._watching():
                    self._recover(url, why)
            self._closed.wait(max(0.0, self.settings.interval - (time.monotonic() - started)))

    def _recover(self, url: str, why: str) -> None:
        with self._lock:  # the thread and the last check of stop_watch never recover the same engine twice
            if self._recovering is not None or url in self._restarted or url in self._failed:
                return
            self._recovering = url
        logger.warning("engine %s is unhealthy (%s): taking it out of the router and restarting it", url, why)
        t0 = time.monotonic()
        try:
            self._take_out(url)
            self._restart(url)
        except Exception as e:  # noqa: BLE001 - reported to the driver through take_restarted
            logger.error("engine %s could not be restarted: %s", url, e)
            with self._lock:
                self._failed[url] = f"{type(e).__name__}: {e}"
        else:
            seconds = time.monotonic() - t0
            logger.warning("engine %s restarted in %.1fs; waiting for its refit", url, seconds)
            with self._lock:
                self._restarted.append(url)
                self.recoveries.append(Recovery(url, why, seconds))
        finally:
            with self._lock:
                self._recovering = None
