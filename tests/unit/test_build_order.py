"""`build_system`'s memory order against fakes of Ray, the engine fleet and the trainers (no processes): colocated
on GPU, the engines start, answer and release all their memory before the trainers load, and the start-up refit
resumes what they released; colocated embedded engines on CPU and disaggregated engines start while the trainers
load (disaggregated, nothing is released)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.config import parse_config
from miles.ray import setup
from miles.ray.colocate import MEMORY_TAGS


class Log(list):
    def __call__(self, *event: object) -> None:
        self.append(event)


class _Ref:
    def __init__(self, log: Log, actor: str, method: str, value: object, args: tuple = ()) -> None:
        self.log, self.actor, self.method, self.value = log, actor, method, value
        self.args = args

    def resolve(self) -> object:
        if (self.actor, self.method) == ("EngineFleet", "get_engine_urls"):
            self.log("engines answer")  # the fleet's constructor returned: every engine is up and healthy
        if (self.actor, self.method) == ("EngineFleet", "host_engines"):
            self.log("engines start in the ranks", tuple(self.args))
        return self.value


class _Actor:
    VALUES = {"get_router_url": "http://router:1", "get_engine_urls": ["http://e0:1", "http://e1:1"]}

    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name = log, name

    def __getattr__(self, method: str) -> object:
        log, name = self.log, self.name
        return type(
            "M", (), {"remote": lambda _, *a, **k: _Ref(log, name, method, _Actor.VALUES.get(method), a)}
        )()


class _FakeRay:
    def __init__(self, log: Log) -> None:
        self.log = log

    def remote(self, cls: type) -> object:
        log = self.log

        class Options:
            def options(self, **_: object) -> Options:
                return self

            def remote(self, *_: object) -> _Actor:
                log("start", cls.__name__)
                return _Actor(log, cls.__name__)

        return Options()


def _install(monkeypatch: pytest.MonkeyPatch, log: Log, gpu: bool) -> None:
    class Group:
        def __init__(self, cfg, placement, num_actor, env_vars, role: str = "actor") -> None:
            self.role = role
            self.workers = [f"{role}-rank{r}" for r in range(num_actor)]

        def init(self, with_ref: bool) -> int:
            log("trainers build", self.role)
            return 0

        def update_weights(
            self, engine_urls: list[str], weight_version: str, flush_cache: bool = True
        ) -> None:
            log("refit", weight_version, tuple(engine_urls))

        def sleep(self) -> None:
            log("sleep", self.role)

        def wake_up(self) -> None:
            log("wake", self.role)

    class Engines:
        def __init__(self, urls: list[str], key: str | None, timeout: float) -> None:
            self.urls = tuple(urls)

        def release_memory(self, tags: list[str]) -> None:
            log("release", tuple(tags), self.urls)

        def resume_memory(self, tags: list[str]) -> None:
            log("resume", tuple(tags), self.urls)

    class Tracker:
        def __init__(self, *a: object, **k: object) -> None:
            pass

    def ray_get(refs, timeout, what):
        return [r.resolve() for r in refs] if isinstance(refs, list) else refs.resolve()

    monkeypatch.setattr(setup, "ray", _FakeRay(log))

    def local_actor(cls: type, *args: object, **kwargs: object) -> _Actor:
        log("start in the driver", cls.__name__)  # an object of the driver's process, no actor of its own
        return _Actor(log, cls.__name__)

    monkeypatch.setattr(setup, "local_actor", local_actor)
    monkeypatch.setattr(setup, "ThreadActor", lambda cls, *a, **k: local_actor(cls))  # a thread of the driver
    monkeypatch.setattr(setup, "ray_get", ray_get)
    monkeypatch.setattr(setup, "init_ray", lambda min_cpus, runtime_envs: log("ray", runtime_envs) or True)
    monkeypatch.setattr(setup, "cluster_has_gpus", lambda: gpu)
    monkeypatch.setattr(  # what the set-up reads of a placement: one engine bundle per rollout worker
        setup, "create_placement", lambda *a, **k: SimpleNamespace(use_gpu=gpu, engine_bundles=[1, 2])
    )
    monkeypatch.setattr(setup, "check_engine_host_reachable", lambda host, placement: None)  # needs real Ray
    monkeypatch.setattr(setup, "RayTrainGroup", Group)
    monkeypatch.setattr(setup, "EngineMemoryControl", Engines)
    monkeypatch.setattr(setup, "Tracker", Tracker)


def _cfg(*extra: str):
    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "3", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--global-batch-size", "4"]  # fmt: skip
    return parse_config(base + list(extra))


URLS = ("http://e0:1", "http://e1:1")


def _events(log: Log) -> list[tuple[object, ...]]:
    return [e for e in log if (e[0] != "start" or e[1] == "EngineFleet") and e[0] != "ray"]


@pytest.mark.parametrize("gpu", [True, False])
def test_colocated_engines_start_and_release_before_the_trainers_build(monkeypatch, gpu):
    """On GPU, and with SGLang engines on CPU (they size their pools on the memory they find)."""
    log = Log()
    _install(monkeypatch, log, gpu)
    system = setup.build_system(_cfg("--colocate", "--rollout-engine", "sglang"))
    first = [
        ("start", "EngineFleet"),
        ("engines answer",),
        ("release", MEMORY_TAGS, URLS),
        ("trainers build", "actor"),
    ]
    if gpu:  # the weights come back for the refit, the trainer sleeps, then the KV cache and graphs come back
        refit = [("resume", ("weights",), URLS), ("refit", "0", URLS), ("sleep", "actor"),
                 ("resume", ("kv_cache", "cuda_graph"), URLS)]  # fmt: skip
    else:  # on CPU the trainer's footprint is the same asleep: everything resumes before the weights move
        refit = [("resume", MEMORY_TAGS, URLS), ("refit", "0", URLS)]
    assert _events(log) == first + refit
    assert not system.choreography.released  # the engines hold everything again, ready to generate
    assert ("ray", True) in log  # SGLang engine actors get a runtime env: Ray's runtime-env agent stays


@pytest.mark.parametrize("engine", ["auto", "local"])
def test_colocated_embedded_engines_on_cpu_start_with_the_trainers(monkeypatch, engine):
    """--no-cpu-engine-in-trainer: no device memory to hand over, the trainers build while the engines start (in
    processes of their own); the engines release once both are up, so the start-up refit resumes the same tags as
    in the GPU order."""
    log = Log()
    _install(monkeypatch, log, gpu=False)
    system = setup.build_system(_cfg("--colocate", "--rollout-engine", engine, "--no-cpu-engine-in-trainer"))
    assert _events(log) == [
        ("start", "EngineFleet"),
        ("trainers build", "actor"),  # before the engines are waited for
        ("engines answer",),
        ("release", MEMORY_TAGS, URLS),
        ("resume", MEMORY_TAGS, URLS),
        ("refit", "0", URLS),
    ]
    assert not system.choreography.released


@pytest.mark.parametrize("engine", ["auto", "local"])
def test_colocated_embedded_engines_on_cpu_start_inside_the_built_ranks_by_default(monkeypatch, engine):
    """The default on CPU: the engines start in the actor ranks' processes once the ranks are built, rank i
    hosting engine i; then release, resume and refit as when they start beside the trainers. The fleet, which
    then only starts and stops them, is an object of the driver's process, not an actor of its own."""
    log = Log()
    _install(monkeypatch, log, gpu=False)
    system = setup.build_system(
        _cfg("--colocate", "--rollout-engine", engine, "--actor-num-gpus-per-node", "2")
    )
    assert _events(log) == [
        ("start in the driver", "RolloutManager"),  # on a thread of the driver (miles.train): no process
        ("start in the driver", "EngineFleet"),
        ("trainers build", "actor"),
        ("engines start in the ranks", (["actor-rank0", "actor-rank1"],)),
        ("engines answer",),
        ("release", MEMORY_TAGS, URLS),
        ("resume", MEMORY_TAGS, URLS),
        ("refit", "0", URLS),
    ]
    assert not system.choreography.released
    if engine == "local":  # no SGLang engine can start: Ray's runtime-env agent is not needed
        assert ("ray", False) in log


def test_colocated_critic_builds_after_the_release_too_and_sleeps(monkeypatch):
    log = Log()
    _install(monkeypatch, log, gpu=True)
    setup.build_system(_cfg("--colocate", "--advantage-estimator", "ppo"))
    events = _events(log)
    release = events.index(("release", MEMORY_TAGS, URLS))
    assert events.index(("trainers build", "actor")) > release
    assert events.index(("trainers build", "critic")) > release
    assert events.index(("sleep", "critic")) < events.index(("refit", "0", URLS))


def test_disaggregated_trainers_build_while_the_engines_start_and_nothing_is_released(monkeypatch):
    log = Log()
    _install(monkeypatch, log, gpu=True)
    setup.build_system(_cfg("--rollout-num-gpus", "2"))
    assert _events(log) == [
        ("start", "EngineFleet"),
        ("trainers build", "actor"),  # before the engines are waited for: both start at once
        ("engines answer",),
        ("refit", "0", URLS),
    ]


def test_replay_starts_trainers_only_and_refits_nothing(monkeypatch):
    """--load-debug-rollout-data: a `ReplaySystem` (no engine fleet, no rollout manager, nothing released or
    refit); with PPO the critic builds too."""
    from miles.ray.colocate import TrainerOnly
    from miles.ray.system import ReplaySystem

    log = Log()
    _install(monkeypatch, log, gpu=True)
    cfg = _cfg("--colocate", "--load-debug-rollout-data", "saved", "--advantage-estimator", "ppo")
    system = setup.build_system(cfg)
    assert isinstance(system, ReplaySystem) and isinstance(system.choreography, TrainerOnly)
    assert system.rollouts == "saved" and system.critic_group is not None
    # colocated, the critic sleeps until it trains (as in a training run)
    assert _events(log) == [("trainers build", "actor"), ("trainers build", "critic"), ("sleep", "critic")]


def test_rollout_only_starts_engines_only(monkeypatch):
    """--debug-rollout-only: a `RolloutOnlySystem` (engines and rollout manager, no trainers, no refit; the
    engines keep the --hf-checkpoint weights), even colocated: nothing to release for."""
    from miles.ray.system import RolloutOnlySystem

    log = Log()
    _install(monkeypatch, log, gpu=True)
    system = setup.build_system(_cfg("--debug-rollout-only", "--colocate"))
    assert isinstance(system, RolloutOnlySystem) and system.engines.engine_urls == list(URLS)
    assert _events(log) == [("start", "EngineFleet"), ("engines answer",)]
    assert ("start", "RolloutManager") in log
