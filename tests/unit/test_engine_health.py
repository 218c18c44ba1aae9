"""HealthMonitor without Ray or servers: checks only while watching (after first_wait), recovers a failed engine
(out of the router, then restarted), hands it to the driver for a refit, reports a failed restart by engine."""

from __future__ import annotations

import threading
import time

import pytest

from miles.ray.engine_health import HealthMonitor, HealthSettings


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class Engines:
    def __init__(self, sick: set[str], restart_error: str | None = None) -> None:
        self.sick, self.restart_error = set(sick), restart_error
        self.checks: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def check(self, url: str, timeout: float) -> str | None:
        with self.lock:
            self.checks.append(url)
            return "no answer to /health_generate within 1s" if url in self.sick else None

    def take_out(self, url: str) -> None:
        self.events.append(("out", url))

    def restart(self, url: str) -> None:
        if self.restart_error:
            raise RuntimeError(self.restart_error)
        self.events.append(("restart", url))
        with self.lock:
            self.sick.discard(url)


def monitor(engines: Engines, first_wait: float = 0.0) -> HealthMonitor:
    return HealthMonitor(
        ["http://a:1", "http://b:1"], HealthSettings(0.02, 1.0, first_wait), engines.check, engines.take_out,
        engines.restart,
    )  # fmt: skip


def test_checks_only_while_watching_and_after_first_wait():
    engines = Engines(sick=set())
    m = monitor(engines, first_wait=0.3)
    try:
        time.sleep(0.2)
        assert engines.checks == []  # not watching
        m.start_watch()
        time.sleep(0.15)
        assert engines.checks == []  # within first_wait
        wait_for(lambda: len(engines.checks) >= 4)
        assert m.stop_watch(5) == []
        n = len(engines.checks)
        time.sleep(0.2)
        assert len(engines.checks) == n
    finally:
        m.close()


def test_failed_engine_is_taken_out_restarted_and_handed_over_for_refit():
    engines = Engines(sick={"http://b:1"})
    m = monitor(engines)
    try:
        m.start_watch()
        wait_for(lambda: engines.events == [("out", "http://b:1"), ("restart", "http://b:1")])
        assert m.take_restarted() == ["http://b:1"] and m.take_restarted() == []
        assert [r.url for r in m.recoveries] == ["http://b:1"] and "health_generate" in m.recoveries[0].reason
        m.done("http://b:1")
        count = engines.checks.count("http://b:1")
        wait_for(lambda: engines.checks.count("http://b:1") > count)  # checked again after its refit
        assert m.stop_watch(5) == [] and len(m.recoveries) == 1
    finally:
        m.close()


def test_failed_restart_names_the_engine():
    engines = Engines(sick={"http://a:1"}, restart_error="engine process exited with code 1 while starting")
    m = monitor(engines)
    try:
        m.start_watch()
        wait_for(lambda: m._failed)
        with pytest.raises(
            RuntimeError,
            match=r"engine restart: http://a:1 could not be restarted: RuntimeError: "
            r"engine process exited with code 1",
        ):
            m.stop_watch(5)
    finally:
        m.close()


def test_stop_watch_checks_once_more_and_recovers_an_engine_that_died_since_the_last_check():
    engines = Engines(sick=set())
    m = HealthMonitor(["http://a:1", "http://b:1"], HealthSettings(3600.0, 1.0, 0.0), engines.check,
                      engines.take_out, engines.restart)  # fmt: skip
    try:
        m.start_watch()
        wait_for(lambda: len(engines.checks) == 2)  # one round, the next one an hour away
        engines.sick.add("http://a:1")  # killed while the rollout ran around it
        assert m.stop_watch(5) == ["http://a:1"]
        assert engines.events == [("out", "http://a:1"), ("restart", "http://a:1")]
    finally:
        m.close()


def test_recover_now_uses_the_given_check_outside_a_watch():
    """Paused engines cannot answer /health_generate: recover_now checks with the caller's (liveness) check,
    restarts the engine that fails it, and hands it over once."""
    engines = Engines(sick={"http://b:1"})
    m = monitor(engines)
    try:
        live: list[str] = []

        def alive(url: str, timeout: float) -> str | None:
            live.append(url)
            return "/health: ConnectError" if url == "http://b:1" else None

        assert m.recover_now(alive) == ["http://b:1"]
        assert live == ["http://a:1", "http://b:1"]
        assert engines.checks == []  # not watching: the monitor's own check never ran
        assert engines.events == [("out", "http://b:1"), ("restart", "http://b:1")]
        assert m.recover_now(lambda url, timeout: None) == []
    finally:
        m.close()
