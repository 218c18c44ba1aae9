"""--fully-async with --use-fault-tolerance: pause and continue skip an engine that does not answer (the health
monitor restarts it), never when fault tolerance is off or no engine answered."""

from __future__ import annotations

import pytest

from miles.rollout.async_worker import _skip_dead_engines

URLS = ["http://a:1", "http://b:1"]


def test_a_dead_engine_is_skipped_only_with_fault_tolerance():
    dead = ConnectionError("b refused")
    _skip_dead_engines(URLS, [None, None], False, "pause_generation")
    _skip_dead_engines(URLS, [None, dead], True, "pause_generation")
    with pytest.raises(ConnectionError, match="b refused"):
        _skip_dead_engines(URLS, [None, dead], False, "pause_generation")


def test_no_engine_answering_raises_even_with_fault_tolerance():
    with pytest.raises(ConnectionError, match="a refused"):
        _skip_dead_engines(
            URLS, [ConnectionError("a refused"), ConnectionError("b")], True, "continue_generation"
        )


@pytest.mark.parametrize("fully_async", [[], ["--fully-async"]], ids=["one-step-off", "fully-async"])
def test_both_async_drivers_accept_fault_tolerance(fully_async):
    """Lifted (issue 25 item 5): the one-step-off driver and --fully-async take --use-fault-tolerance."""
    from miles.config.parser import parse_config
    from miles.train_async import _refuse

    argv = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "2", "--rollout-batch-size",
            "2", "--global-batch-size", "2", "--rollout-num-gpus", "1", "--use-fault-tolerance"]  # fmt: skip
    cfg = parse_config(argv + fully_async)
    assert cfg.cluster.use_fault_tolerance and _refuse(cfg) is None


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Fleet:
    def __init__(self, dead: list[list[str]]):
        self.dead, self.readmitted = list(dead), []
        self.recover_dead = _Remote(lambda: self.dead.pop(0) if self.dead else [])
        self.readmit = _Remote(lambda urls: self.readmitted.append(list(urls)))


class _Choreo:
    def __init__(self):
        self.calls: list[tuple] = []

    def refit_restarted(self, urls, weight_version):
        self.calls.append(("restarted", list(urls), weight_version))


def _faults(monkeypatch, enabled: bool, dead: list[list[str]]):
    from types import SimpleNamespace

    import miles.ray.async_faults as af

    monkeypatch.setattr(af, "ray_get", lambda value, timeout, phase: value)
    cfg = SimpleNamespace(
        cluster=SimpleNamespace(use_fault_tolerance=enabled), train=SimpleNamespace(train_timeout=9)
    )
    fleet, choreo = _Fleet(dead), _Choreo()
    engines = SimpleNamespace(cfg=cfg, fleet=fleet, timeout=5.0)
    return af.AsyncFaults(SimpleNamespace(engines=engines, choreography=choreo)), fleet, choreo


def _refit_failing(times: int, choreo: _Choreo):
    def refit():
        choreo.calls.append(("all",))
        if sum(c == ("all",) for c in choreo.calls) <= times:
            raise RuntimeError("weight update failed: rank 0: EngineUnreachable")
        return {"perf/refit_checksum_s": 1.0}

    return refit


def test_a_refit_that_meets_a_dead_engine_restarts_it_refits_it_alone_then_all(monkeypatch):
    faults, fleet, choreo = _faults(monkeypatch, True, dead=[["http://a:1"]])
    metrics = faults.refit("2", _refit_failing(1, choreo), restarted=[])
    assert choreo.calls == [("all",), ("restarted", ["http://a:1"], "2"), ("all",)]
    assert fleet.readmitted == [["http://a:1"]]  # back behind the router only after its refit
    assert metrics == {"perf/refit_checksum_s": 1.0, "async/engine_restarts": 1.0}


def test_a_refit_failure_without_a_dead_engine_or_fault_tolerance_raises(monkeypatch):
    faults, fleet, choreo = _faults(monkeypatch, True, dead=[])
    with pytest.raises(RuntimeError, match="weight update failed"):
        faults.refit("2", _refit_failing(1, choreo), restarted=["http://b:1"])
    assert fleet.readmitted == []  # never readmitted without a refit
    faults, fleet, choreo = _faults(monkeypatch, False, dead=[["http://a:1"]])
    with pytest.raises(RuntimeError, match="weight update failed"):
        faults.refit("2", _refit_failing(1, choreo), restarted=[])
    assert fleet.dead == [["http://a:1"]]  # no recovery asked for
    faults, fleet, choreo = _faults(monkeypatch, True, dead=[["a"], ["a"], ["a"]])
    with pytest.raises(RuntimeError, match="weight update failed"):  # at most REFIT_ATTEMPTS tries
        faults.refit("2", _refit_failing(5, choreo), restarted=[])
    assert sum(c == ("all",) for c in choreo.calls) == 3
