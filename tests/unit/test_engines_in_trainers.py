"""Where the embedded engines run: inside the CPU training ranks' processes on a colocated run by default
(`engines_in_trainers`, `EngineFleet.host_engines`), in processes of their own behind their own Ray actors with
--no-cpu-engine-in-trainer, on GPU, with SGLang, external or disaggregated engines and --use-fault-tolerance."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from miles.config import parse_config
from miles.engines import sglang_engine
from miles.ray import engine_fleet
from miles.ray.engine_fleet import EngineFleet, engines_in_trainers

BASE = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--actor-num-gpus-per-node", "2"]  # fmt: skip


def _cfg(*extra: str, run_dir: str = "/tmp/unused"):
    return parse_config(BASE + ["--run-dir", run_dir] + list(extra))


@pytest.mark.parametrize(
    ("extra", "gpu", "inside"),
    [
        (["--colocate"], False, True),
        (["--colocate", "--rollout-engine", "local"], False, True),
        (["--colocate", "--rollout-num-gpus", "1"], False, True),  # fewer engines than ranks: ranks 0..n-1
        (["--colocate", "--no-cpu-engine-in-trainer"], False, False),  # the off switch
        (["--colocate"], True, False),  # GPU: the engine stays a process of its own
        (["--colocate", "--rollout-engine", "sglang"], False, False),
        (["--colocate", "--use-fault-tolerance"], False, False),  # a restart must not kill the trainer
        (["--colocate", "--rollout-num-gpus-per-engine", "2"], False, False),
        (["--rollout-num-gpus", "2"], False, False),  # disaggregated: engines generate while ranks train
        (["--colocate", "--debug-rollout-only"], False, False),  # no trainers to host them
    ],
)
def test_which_runs_put_the_engines_inside_the_ranks(extra, gpu, inside):
    assert engines_in_trainers(_cfg(*extra), use_gpu=gpu) is inside


class _Call:
    def __init__(self, fn):
        self.remote = fn


class _Rank:
    def __init__(self, log: list, name: str) -> None:
        self.launch_engine = _Call(
            lambda kwargs: log.append((name, kwargs)) or f"http://127.0.0.1:{len(log)}"
        )
        self.shutdown_engine = _Call(lambda: log.append((name, "shutdown")))


def _fake_ray(monkeypatch, launched: list) -> None:
    monkeypatch.setattr(engine_fleet, "ray_get", lambda refs, timeout, what: refs)

    class Actor:
        def __init__(self, **kwargs):
            launched.append(kwargs)
            self.launch = _Call(lambda: f"http://127.0.0.1:{100 + len(launched)}")
            self.shutdown = _Call(lambda: None)

    class Cls:
        def options(self, **_):
            return SimpleNamespace(remote=lambda **kw: Actor(**kw))

    monkeypatch.setattr(sglang_engine, "make_engine_actor_class", lambda: Cls())


def test_a_hosted_fleet_launches_no_engine_actor_and_starts_engine_i_in_rank_i(monkeypatch, tmp_path):
    launched: list = []
    _fake_ray(monkeypatch, launched)
    cfg = _cfg("--colocate", "--rollout-num-gpus", "1", run_dir=str(tmp_path))
    fleet = EngineFleet(cfg, SimpleNamespace(use_gpu=False), num_rollout_workers=1)
    assert launched == [] and fleet.engine_urls == []  # nothing started before the ranks are up
    log: list = []
    fleet.host_engines([_Rank(log, "rank0"), _Rank(log, "rank1")])
    assert [name for name, _ in log] == ["rank0"] and fleet.engine_urls == ["http://127.0.0.1:1"]
    kwargs = log[0][1]
    assert kwargs["model_path"] == "m" and kwargs["log_path"].endswith("logs/engine_0.log")
    assert kwargs["local_args"]["num-threads"] == 1 and kwargs["local_args"]["random-seed"] == 42 + 0
    assert fleet.get_router_url() == "http://127.0.0.1:1"  # no router: generation goes straight to it
    with pytest.raises(RuntimeError, match="already started"):
        fleet.host_engines([_Rank(log, "rank0")])
    fleet.shutdown()
    assert log[-1] == ("rank0", "shutdown")


def test_off_switch_and_fault_tolerance_launch_one_engine_actor_each(monkeypatch, tmp_path):
    for flag in ("--no-cpu-engine-in-trainer", "--use-fault-tolerance"):
        launched: list = []
        _fake_ray(monkeypatch, launched)
        monkeypatch.setattr(EngineFleet, "_start_router", lambda self, log_dir: None)
        cfg = _cfg("--colocate", flag, run_dir=str(tmp_path))
        placement = SimpleNamespace(use_gpu=False, engine_gpus=lambda n: None, engine_options=lambda i, n: {})
        fleet = EngineFleet(cfg, placement, num_rollout_workers=2)
        assert len(launched) == 2 and [k["kind"] for k in launched] == ["local", "local"], flag
        assert fleet.hosts == [] and len(fleet.engine_urls) == 2
        if fleet.monitor is not None:
            fleet.monitor.close()


@pytest.mark.parametrize(
    ("extra", "gpu", "in_driver"),
    [
        (["--colocate"], False, True),  # the fleet only starts and stops the engines inside the ranks
        (["--colocate", "--router-policy", "round_robin"], False, False),  # it runs a router process
        (["--colocate", "--no-cpu-engine-in-trainer"], False, False),  # it launches engine actors
        (["--colocate"], True, False),
        (["--colocate", "--use-fault-tolerance"], False, False),  # its health monitor restarts engines
    ],
)
def test_which_runs_keep_the_fleet_in_the_drivers_process(extra, gpu, in_driver):
    placement = SimpleNamespace(use_gpu=gpu)
    assert engine_fleet.fleet_in_driver(_cfg(*extra), placement) is in_driver
    assert not engine_fleet.fleet_in_driver(_cfg(*extra), None)  # nothing placed: external engines


def test_a_fleet_in_the_driver_installs_no_stacks_handler_and_leaves_the_environment(monkeypatch, tmp_path):
    """The driver's own SIGUSR1 handler (its hang dumps) and environment stay as they are."""
    from miles.utils import hang_dump

    installed: list = []
    monkeypatch.setattr(hang_dump, "install", lambda *a, **k: installed.append(a))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = _cfg("--colocate", run_dir=str(tmp_path))
    EngineFleet(cfg, SimpleNamespace(use_gpu=False), num_rollout_workers=2, in_driver=True)
    assert installed == [] and "HF_HUB_OFFLINE" not in os.environ
    EngineFleet(cfg, SimpleNamespace(use_gpu=False), num_rollout_workers=2)  # an actor's process of its own
    assert [a[1] for a in installed] == ["engine-fleet"]


def test_a_local_actor_answers_remote_calls_at_once_and_raises_from_remote(monkeypatch):
    from miles.ray import utils

    monkeypatch.setattr(utils.ray, "put", lambda value: ("ref", value))

    class Thing:
        calls: list = []

        def add(self, a, b=0):
            self.calls.append((a, b))
            return a + b

        def fail(self):
            raise ValueError("no")

    handle = utils.local_actor(Thing)
    assert handle.add.remote(1, b=2) == ("ref", 3) and Thing.calls == [(1, 2)]  # ran before any get
    with pytest.raises(ValueError, match="no"):
        handle.fail.remote()


@pytest.mark.parametrize(
    ("extra", "sglang_installed", "may_ask"),
    [
        (["--colocate"], False, False),  # auto without sglang: the embedded engine, no runtime env
        (["--colocate"], True, True),  # auto with sglang: SGLang wherever Ray finds GPUs
        (["--colocate", "--rollout-engine", "local"], True, False),
        (["--colocate", "--rollout-engine", "sglang"], False, True),
        (["--rollout-engine", "sglang", "--rollout-external-engine-addrs", "127.0.0.1:30000"], True, False),
    ],
)
def test_which_runs_may_give_an_engine_actor_a_runtime_env(monkeypatch, extra, sglang_installed, may_ask):
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name: str, *args):
        return (object() if sglang_installed else None) if name == "sglang" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert engine_fleet.engines_may_ask_runtime_env(_cfg(*extra)) is may_ask
