"""The rollout manager on a thread of the driver's process (`miles.ray.setup.rollout_in_driver`, `ThreadActor`)
instead of a Ray actor of its own: which runs do it, how its calls behave as an actor's do (in order, on one
thread, errors and deadlines through `ray_get`), and what it leaves of the driver's process alone."""

from __future__ import annotations

import gc
import os
import threading
import time
from types import SimpleNamespace

import pytest

from miles.config import parse_config
from miles.ray import setup
from miles.ray.utils import PhaseTimeoutError, ThreadActor, ray_get, ready

BASE = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--actor-num-gpus-per-node", "2"]  # fmt: skip


def _cfg(*extra: str):
    return parse_config(BASE + ["--run-dir", "/tmp/unused"] + list(extra))


@pytest.mark.parametrize(
    ("extra", "gpu", "environ", "in_driver"),
    [
        (["--colocate"], False, {}, True),  # the CPU quickstart with miles.train
        (["--colocate"], False, {"MILES_DRIVER_OVERLAPS_TRAINING": "1"}, False),  # an asynchronous driver
        (["--colocate"], False, {"RAY_ADDRESS": "10.0.0.1:6379"}, False),  # a cluster
        (["--colocate"], True, {}, False),  # GPU
        (["--colocate", "--rollout-engine", "sglang"], False, {}, False),
        (["--colocate", "--use-fault-tolerance"], False, {}, False),
        (["--colocate", "--router-policy", "round_robin"], False, {}, False),
        (["--colocate", "--no-cpu-engine-in-trainer"], False, {}, False),  # engines of their own
        (["--rollout-num-gpus", "2"], False, {}, False),  # disaggregated
    ],
)
def test_which_runs_keep_the_rollout_manager_in_the_driver(monkeypatch, extra, gpu, environ, in_driver):
    for name in ("MILES_DRIVER_OVERLAPS_TRAINING", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert setup.rollout_in_driver(_cfg(*extra), SimpleNamespace(use_gpu=gpu)) is in_driver
    assert not setup.rollout_in_driver(_cfg(*extra), None)  # nothing placed: external engines


class _Worker:
    def __init__(self, log: list, fail: bool = False) -> None:
        log.append(("init", threading.current_thread().name))
        if fail:
            raise ValueError("no tokenizer at m")
        self.log = log

    def step(self, n: int, delay: float = 0.0) -> int:
        time.sleep(delay)
        self.log.append(("step", n, threading.current_thread().name))
        return n * 10

    def close(self) -> None:
        self.log.append(("close",))


def test_a_thread_actor_builds_and_answers_in_order_on_one_thread_of_its_own():
    log: list = []
    actor = ThreadActor(_Worker, log)
    first, second = actor.step.remote(1, delay=0.2), actor.step.remote(2)  # queued, not run by the caller
    assert ray_get([first, second][1], 10, "second") == 20 and ray_get(first, 10, "first") == 10
    (name,) = {entry[-1] for entry in log}
    assert name == "miles-_Worker" and name != threading.current_thread().name
    assert [entry[:2] for entry in log] == [("init", name), ("step", 1), ("step", 2)]
    actor.stop(timeout=10, last="close")
    assert log[-1] == ("close",) and not actor._thread.is_alive()


def test_a_thread_actor_whose_constructor_failed_raises_it_from_every_call():
    actor = ThreadActor(_Worker, [], fail=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="_Worker failed to start: ValueError") as info:
            ray_get(actor.step.remote(1), 10, "connect")
        assert isinstance(info.value.__cause__, ValueError)
    actor.stop(timeout=10, last="close")  # no object: nothing to close


def test_a_thread_actors_errors_reach_the_caller_and_its_deadline_names_the_phase(monkeypatch):
    from miles.ray import utils

    monkeypatch.setattr(utils, "expired", lambda message, stalled: message)  # no hang folder to dump into
    actor = ThreadActor(_Worker, [])
    with pytest.raises(TypeError):
        ray_get(actor.step.remote(), 10, "step")  # a call's own error
    slow = actor.step.remote(3, delay=0.5)
    assert not ready(slow, timeout=0.05)
    with pytest.raises(PhaseTimeoutError, match=r"timed out after 0s waiting for phase 'rollout 3'"):
        ray_get(slow, 0.1, "rollout 3")
    assert ready(slow, timeout=10) and ray_get(slow, 10, "rollout 3") == 30
    actor.stop(timeout=10)


def test_in_the_driver_the_rollout_manager_leaves_the_drivers_environment_stacks_handler_and_gc_alone(
    monkeypatch,
):
    from miles.ray.rollout_manager import RolloutManager
    from miles.rollout import runner
    from miles.utils import hang_dump, tokenizer_load

    monkeypatch.setattr(runner, "RolloutRunner", lambda *a, **k: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(tokenizer_load, "load_tokenizer", lambda path: "tokenizer")
    installed, frozen = [], []
    monkeypatch.setattr(hang_dump, "install", lambda *a, **k: installed.append(a[1]))
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = _cfg("--colocate")
    RolloutManager(cfg, in_driver=True).close()
    assert installed == [] and frozen == [] and "HF_HUB_OFFLINE" not in os.environ
    RolloutManager(cfg)  # an actor's process of its own
    assert installed == ["rollout-manager"] and frozen == [1] and os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_rollout_past_its_deadline_in_the_driver_fails_naming_the_phase(monkeypatch):
    from miles.ray import system, utils

    monkeypatch.setattr(utils, "expired", lambda message, stalled: message)

    stuck = threading.Event()

    class Manager:
        def generate(self, rollout_id: int) -> tuple[list, dict]:
            if rollout_id:
                stuck.wait(30)
            return [], {"rollout": float(rollout_id)}

    actor = ThreadActor(Manager)
    side = system.EngineSide(cfg=_cfg("--colocate", "--rollout-timeout", "0.2"), rollout=actor, fleet=None,
                             engine_urls=["http://e0:1"])  # fmt: skip
    assert side.generate(0) == ([], {"rollout": 0.0})
    with pytest.raises(PhaseTimeoutError, match=r"phase 'rollout 1' \(--rollout-timeout\)"):
        side.generate(1)
    stuck.set()
    actor.stop(timeout=10)


def test_shutdown_closes_the_rollout_manager_in_the_driver_and_kills_no_actor_for_it(monkeypatch):
    from miles.ray import system

    killed: list = []
    monkeypatch.setattr(system.ray, "kill", killed.append)
    log: list = []
    actor = ThreadActor(_Worker, log)
    fleet = object()  # a Ray actor handle of the fleet's own
    engines = SimpleNamespace(
        rollout=actor, fleet=fleet, stop=lambda fast: log.append(("engines stop", fast))
    )
    nothing = SimpleNamespace(close=lambda: None)
    run = system._Run(cfg=None, tracker=nothing, start_rollout_id=0, progress=nothing, owns_ray=False)
    run._shutdown(False, engines, [], None)  # type: ignore[arg-type]
    assert [e[0] for e in log] == ["init", "engines stop", "close"] and not actor._thread.is_alive()
    assert killed == [fleet]  # the fleet's actor goes; the rollout manager was no actor
