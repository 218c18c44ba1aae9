"""Agent sessions with the one-step-off driver (issue 26 item 5): `miles.train_async` without --fully-async takes
--use-session-server, because a session lives inside one rollout's generation (`generate_with_agent` closes it
before the rollout returns) and the driver waits for that generation before every refit: no session crosses a
refit, so every turn of a rollout's sessions is sampled by one weight version. --fully-async stays refused."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from miles.config.parser import ConfigError, parse_config

ARGV = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "3", "--rollout-batch-size", "2",
        "--global-batch-size", "2", "--rollout-num-gpus", "1", "--use-session-server",
        "--agent-function-path", "a.b:run"]  # fmt: skip


def test_the_one_step_off_driver_takes_sessions_and_fully_async_refuses_them() -> None:
    from miles.train_async import _refuse

    cfg = parse_config(ARGV)
    assert cfg.rollout.use_session_server and not cfg.rollout.fully_async and _refuse(cfg) is None
    with pytest.raises(ConfigError) as info:
        parse_config([*ARGV, "--fully-async"])
    assert any(
        "--use-session-server=True: is not supported with --fully-async" in v and "across" in v
        for v in info.value.violations
    ), info.value.violations


class _Ref:
    def __init__(self, rollout_id: int) -> None:
        self.rollout_id = rollout_id


class _Rollout:
    """The rollout manager: generation `k` runs its agent sessions from launch until the driver collects it;
    each turn samples with the engines' weight version of that moment."""

    def __init__(self, log: list[tuple], engines: dict[str, str]) -> None:
        self.log, self.engines = log, engines
        self.generate = SimpleNamespace(remote=self._launch)

    def _launch(self, rollout_id: int) -> _Ref:
        self.log.append(("open sessions", rollout_id, self.engines["version"]))
        return _Ref(rollout_id)

    def collect(self, rollout_id: int) -> tuple[list, dict]:
        self.log.append(("close sessions", rollout_id, self.engines["version"]))
        return [], {}


def test_no_session_crosses_a_refit_of_the_one_step_off_loop(monkeypatch) -> None:
    import ray

    import miles.ray.utils as ray_utils
    import miles.train_async as ta

    log: list[tuple] = []
    engines = {"version": "0"}
    rollout = _Rollout(log, engines)

    def ray_get(ref, timeout, phase):  # noqa: ANN001, ANN202
        return rollout.collect(ref.rollout_id) if isinstance(ref, _Ref) else ref

    def refit(weight_version: str, **_kw) -> None:  # noqa: ANN003
        log.append(("refit", weight_version))
        engines["version"] = weight_version

    monkeypatch.setattr(ray_utils, "ray_get", ray_get)
    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ta, "num_rollouts", lambda cfg: 3)
    monkeypatch.setattr(ta, "eval_before_train", lambda cfg, system: None)
    monkeypatch.setattr(ta, "train_rollout", lambda cfg, system, rid, samples: {})
    monkeypatch.setattr(ta, "maybe_save", lambda cfg, system, rid: None)
    monkeypatch.setattr(ta, "finish_step", lambda cfg, system, rid, metrics: None)
    cfg = SimpleNamespace(
        cluster=SimpleNamespace(use_fault_tolerance=False), train=SimpleNamespace(train_timeout=9)
    )
    system = SimpleNamespace(
        mode="train",
        choreography=SimpleNamespace(refit=refit),
        timer=SimpleNamespace(phase=lambda name: nullcontext()),
        rollout_deadline=None,
        start_rollout_id=0,
        engines=SimpleNamespace(rollout=rollout, cfg=cfg, fleet=None, timeout=5.0),
    )
    ta.run_async_loop(cfg, system)

    opened = {rid: i for i, (what, rid, *_) in enumerate(log) if what == "open sessions"}
    closed = {rid: i for i, (what, rid, *_) in enumerate(log) if what == "close sessions"}
    refits = [i for i, e in enumerate(log) if e[0] == "refit"]
    assert sorted(opened) == sorted(closed) == [0, 1, 2] and len(refits) == 3
    for rid in opened:  # no refit while a rollout's sessions are open
        assert not [i for i in refits if opened[rid] < i < closed[rid]], log
        assert log[opened[rid]][2] == log[closed[rid]][2] == str(max(rid - 1, 0))  # one step off
    assert opened[1] < refits[0]  # still one step off: rollout 1 generates while rollout 0 trains
