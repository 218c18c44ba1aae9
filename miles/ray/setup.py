"""Builds the running system for the driver: Ray, placement, training group, engine fleet, rollout manager,
tracking; one builder per run mode (`miles.ray.system`: train, rollout-only, replay)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import time
from typing import TYPE_CHECKING

import ray

from miles.ray.colocate import MEMORY_TAGS, MemoryChoreography, TrainerOnly
from miles.ray.engine_fleet import (
    EngineFleet,
    engines_in_trainers,
    engines_may_ask_runtime_env,
    fleet_in_driver,
)
from miles.ray.placement import Placement, cluster_has_gpus, create_placement
from miles.ray.rollout_manager import RolloutManager
from miles.ray.system import (
    ROLLOUT_STATE_KEY,
    EngineSide,
    ReplaySystem,
    RolloutOnlySystem,
    System,
    TrainSystem,
)
from miles.ray.train_group import RayTrainGroup
from miles.ray.utils import ThreadActor, cpu_trainer_threads, init_ray, local_actor, ray_get
from miles.utils.engine_control_http import EngineMemoryControl
from miles.utils.progress import ProgressBar, progress_bar, progress_enabled, progress_env
from miles.utils.tracking import Tracker
from miles.utils.types import ActorHandle

if TYPE_CHECKING:
    from miles.config import Config

logger = logging.getLogger(__name__)


def worker_counts(cfg: Config) -> tuple[int, int]:
    """(training workers, rollout workers to place); external engines take no place."""
    c = cfg.cluster
    num_actor = c.actor_num_nodes * c.actor_num_gpus_per_node
    if c.rollout_external:
        return num_actor, 0
    num_rollout = c.rollout_num_gpus if c.rollout_num_gpus is not None else num_actor
    return num_actor, num_rollout


def needs_reference_model(cfg: Config) -> bool:
    return bool(cfg.algo.use_kl_loss or cfg.algo.kl_coef != 0)


def resume_rollout_side(
    cfg: Config, rollout: ActorHandle, train_group: RayTrainGroup | None, start: int, timeout: float
) -> None:
    """Put the data cursor (and partial-rollout buffer) where the resumed checkpoint left it, and say so; a
    checkpoint without one (older runs) gets the cursor derived from the rollout id."""
    if start == 0:
        ray_get(rollout.set_start_rollout.remote(0), timeout, "positioning the data cursor")
        return
    assert train_group is not None, "only trainers resume a checkpoint (start > 0)"
    extra = train_group.resume_state()
    if ROLLOUT_STATE_KEY in extra:
        raw = extra[ROLLOUT_STATE_KEY]
        if not isinstance(raw, str):
            raise ValueError(
                f"--load={cfg.checkpoint.load}: the checkpoint's {ROLLOUT_STATE_KEY} is a "
                f"{type(raw).__name__}, not the JSON text miles writes there"
            )
        state = json.loads(raw)
        ray_get(rollout.load_state_dict.remote(state), timeout, "restoring the data cursor")
        ds = state["data_source"]
        how = (
            f"data cursor epoch {ds['epoch']} offset {ds['offset']}, {len(state['buffer'])} buffered group(s)"
        )
    else:
        ray_get(rollout.set_start_rollout.remote(start), timeout, "positioning the data cursor")
        how = "data cursor derived from the rollout id (the checkpoint has none)"
    print(f"resumed from {cfg.checkpoint.load} at rollout {start}: {how}", flush=True)


def with_run_engine_key(cfg: Config) -> Config:
    """`cfg` with an engine admin key: `--engine-api-key` when set, else a fresh random one for this run.

    The engines get it by environment (never on a command line), the trainers and the rollout side through
    their Ray actor arguments; so without a key from the user, only this run can refit or pause its engines
    (refit payloads are unpickled from authenticated requests only). The run's saved config redacts it.
    External engines have their own admin key (or none), which only `--engine-api-key` can give."""
    if cfg.engine.engine_api_key or cfg.cluster.rollout_external:
        return cfg
    key = secrets.token_urlsafe(32)
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, engine_api_key=key))


def check_external_refit(cfg: Config, use_gpu: bool, num_actor: int) -> None:
    """Fail before anything starts when the trainer could not refit the external engines (see
    `miles.engines.external.refit_path_problems`); a rollout-only run refits nothing."""
    if not cfg.cluster.rollout_external or num_actor == 0:
        return
    from miles.engines.external import engine_url, refit_path_problems

    urls = [engine_url(a) for a in cfg.cluster.rollout_external_engine_addrs or []]
    problems = refit_path_problems(urls, use_gpu, num_actor, cfg.cluster.rollout_num_gpus_per_engine)
    if problems:
        raise ValueError(
            "--rollout-external-engine-addrs: the trainer cannot refit these engines:\n  - "
            + "\n  - ".join(problems)
        )


def check_engine_host_reachable(engine_host: str, placement: Placement) -> None:
    """Refuse a loopback --engine-host once Ray has placed trainers and engines on more than one machine."""
    from miles.config.validate import loopback_engine_host_problem

    nodes = set(ray.util.placement_group_table(placement.pg)["bundles_to_node_id"].values())
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    problem = loopback_engine_host_problem(engine_host, {address.get(n, n) for n in nodes})
    if problem:
        raise ValueError(problem)


def _engine_urls(fleet: ActorHandle, timeout: float) -> tuple[str, list[str]]:
    """The router's and the engines' URLs, once every engine answers its health check (the fleet's constructor
    waits for them)."""
    router_url, engine_urls = ray_get(
        [fleet.get_router_url.remote(), fleet.get_engine_urls.remote()], timeout, "starting the engines"
    )
    return router_url, engine_urls


def build_system(cfg: Config) -> System:
    """Engines, router, rollout manager and trainers, placed and started; the engines hold the trainer's weights.

    Colocated on GPU, the engines start first and release their memory before the trainers load (the memory
    order: engines sized on free devices, trainers after); disaggregated, and colocated on CPU (no device memory
    to hand over), engines and trainers start at once.

    Replay debugging leaves a side out: --load-debug-rollout-data starts no engines (and refits nothing),
    --debug-rollout-only starts no trainers (the engines keep the --hf-checkpoint weights)."""
    cfg = with_run_engine_key(cfg)
    if cfg.debug.load_debug_rollout_data is not None:
        return _build_replay(cfg, cfg.debug.load_debug_rollout_data)
    if cfg.debug.debug_rollout_only:
        return _build_rollout_only(cfg)
    return _build_train(cfg)


def _build_train(cfg: Config) -> TrainSystem:
    phases = StartupPhases()
    num_actor, num_rollout = worker_counts(cfg)
    has_critic = cfg.algo.advantage_estimator == "ppo"
    owns_ray, use_gpu = _start_ray(cfg, num_actor, num_rollout)
    phases.done("ray")
    placement = _place(cfg, num_actor, num_rollout, use_gpu, has_critic)
    tracker = _tracker(cfg)
    phases.done("placement")
    timeout = float(cfg.train.train_timeout)
    fleet, rollout = _start_rollout_side(cfg, placement, num_rollout)
    engines: tuple[str, list[str]] | None = None  # (router URL, engine URLs) once the engines answer
    released: list[str] = []  # the memory tags the engines hold released when the choreography starts
    concurrent = cfg.cluster.colocate and colocated_engines_load_with_trainers(cfg, use_gpu)
    if cfg.cluster.colocate and not concurrent:
        # the memory order of colocation: the engines size their memory pools (--sglang-mem-fraction-static is a
        # fraction of the memory free when they start) on devices the trainers do not use yet, give it all back,
        # and only then do the trainers load; disaggregated, both start at once
        engines, released = _colocated_engines_released(cfg, fleet, timeout)
        phases.done("engines")
    train_group, critic_group, start = _start_trainers(cfg, placement, num_actor, has_critic, tracker)
    phases.done("trainers")
    if concurrent:  # the engines (started with the fleet above) loaded while the trainers did
        if engines_in_trainers(cfg, use_gpu):  # or they start now, inside the training ranks' processes
            ray_get(
                fleet.host_engines.remote(train_group.workers), timeout, "starting the engines in the ranks"
            )
        engines, released = _colocated_engines_released(cfg, fleet, timeout)
        phases.done("engines (with the trainers)")
    side = _connect(cfg, fleet, rollout, engines, train_group, start)
    phases.done("engines and rollout manager" if engines is None else "rollout manager")
    choreography = MemoryChoreography(
        cfg.cluster.colocate,
        train_group,
        EngineMemoryControl(
            side.engine_urls, cfg.engine.engine_api_key, float(cfg.rollout.rollout_request_timeout)
        ),
        side.engine_urls,
        critic=critic_group,
        trainer_offload=use_gpu,  # on CPU the trainers' sleep/wake move nothing
        released=released,
        keep_weights=cfg.lora.lora_rank > 0 and cfg.lora.lora_refit == "adapter",
        engines_in_trainers=engines_in_trainers(cfg, use_gpu),
    )
    # engines start from the trainer's (possibly resumed) weights; fresh engines released nothing to resume
    choreography.refit(weight_version=str(start))
    phases.done("first refit")
    logger.info("start-up: %s", phases)
    return TrainSystem(
        cfg=cfg,
        tracker=tracker,
        start_rollout_id=start,
        progress=_ready(cfg, num_actor, num_rollout, use_gpu, start),
        owns_ray=owns_ray,
        train_group=train_group,
        critic_group=critic_group,
        placement=placement,
        engines=side,
        choreography=choreography,
    )


def colocated_engines_load_with_trainers(cfg: Config, use_gpu: bool) -> bool:
    """Whether colocated engines start while the trainers load, instead of first. On GPU no: the engines size
    their memory pools on devices the trainers do not use yet and give it all back before the trainers load
    (SGLang's --sglang-mem-fraction-static is a fraction of the memory free when it starts). The embedded engine
    on CPU yes: there is no device memory to hand over (its pools are host memory, sized by no free-memory
    fraction, and a release frees nothing the trainers could use), so the two largest start-up phases overlap.
    SGLang on CPU keeps the GPU order (it sizes its pools on the memory it finds). Either way the engines release
    everything once both sides are up, so the start-up refit resumes the same tags."""
    # without GPUs --rollout-engine auto is the embedded engine (`miles.engines.sglang_engine.resolve_engine_kind`)
    return not use_gpu and cfg.rollout.rollout_engine != "sglang"


def _colocated_engines_released(
    cfg: Config, fleet: ActorHandle, timeout: float
) -> tuple[tuple[str, list[str]], list[str]]:
    """Wait for the colocated engines to answer, then release all their memory (the trainers load, or have
    loaded, on the same devices): ((router URL, engine URLs), the tags released)."""
    engines = _engine_urls(fleet, timeout)
    EngineMemoryControl(
        engines[1], cfg.engine.engine_api_key, float(cfg.rollout.rollout_request_timeout)
    ).release_memory(list(MEMORY_TAGS))
    logger.info("colocated: %d engine(s) started and released their memory", len(engines[1]))
    return engines, list(MEMORY_TAGS)


class StartupPhases:
    """Wall time of the start-up phases, logged as one line: `ray 1.2s, placement 0.1s, ... (total 9.8s)`.
    A phase lasts from the previous one's end; the first from the driver process's start (imports, config)."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = [("driver", _process_age())]
        self.last = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.phases.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {secs:.1f}s" for name, secs in self.phases)
        return f"{parts} (total {sum(secs for _, secs in self.phases):.1f}s)"


def _process_age() -> float:
    """Seconds since this process started (its imports and config parsing): 0.0 where /proc does not tell."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _build_rollout_only(cfg: Config) -> RolloutOnlySystem:
    num_rollout = worker_counts(cfg)[1]
    owns_ray, use_gpu = _start_ray(cfg, 0, num_rollout)
    # nothing to place: a rollout-only run on external engines
    placement = _place(cfg, 0, num_rollout, use_gpu, has_critic=False) if num_rollout else None
    tracker = _tracker(cfg)
    fleet, rollout = _start_rollout_side(cfg, placement, num_rollout)
    side = _connect(cfg, fleet, rollout, None, None, 0)
    return RolloutOnlySystem(
        cfg=cfg,
        tracker=tracker,
        start_rollout_id=0,
        progress=_ready(cfg, 0, num_rollout, use_gpu, 0),
        owns_ray=owns_ray,
        engines=side,
        placement=placement,
    )


def _build_replay(cfg: Config, rollouts: str) -> ReplaySystem:
    num_actor = worker_counts(cfg)[0]
    has_critic = cfg.algo.advantage_estimator == "ppo"
    owns_ray, use_gpu = _start_ray(cfg, num_actor, 0)
    placement = _place(cfg, num_actor, 0, use_gpu, has_critic)
    tracker = _tracker(cfg)
    train_group, critic_group, start = _start_trainers(cfg, placement, num_actor, has_critic, tracker)
    return ReplaySystem(
        cfg=cfg,
        tracker=tracker,
        start_rollout_id=start,
        progress=_ready(cfg, num_actor, 0, use_gpu, start),
        owns_ray=owns_ray,
        train_group=train_group,
        critic_group=critic_group,
        placement=placement,
        rollouts=rollouts,
        choreography=TrainerOnly(),
    )


def _start_ray(cfg: Config, num_actor: int, num_rollout: int) -> tuple[bool, bool]:
    """Start (or join) Ray with a CPU per worker; (this run started Ray, the cluster has GPUs)."""
    colocate = cfg.cluster.colocate
    owns_ray = init_ray(
        min_cpus=(max(num_actor, num_rollout) if colocate else num_actor + num_rollout) + 1,
        runtime_envs=engines_may_ask_runtime_env(cfg),
    )
    use_gpu = cluster_has_gpus()
    check_external_refit(cfg, use_gpu, num_actor)
    return owns_ray, use_gpu


def _place(cfg: Config, num_actor: int, num_rollout: int, use_gpu: bool, has_critic: bool) -> Placement:
    placement = create_placement(num_actor, num_rollout, cfg.cluster.colocate, use_gpu, has_critic=has_critic)
    if num_rollout:
        check_engine_host_reachable(cfg.engine.engine_host, placement)
    return placement


def _tracker(cfg: Config) -> Tracker:
    return Tracker(
        cfg.log.run_dir,
        use_wandb=cfg.log.use_wandb,
        wandb_project=cfg.log.wandb_project,
        wandb_group=cfg.log.wandb_group,
        wandb_key=cfg.log.wandb_key,
        wandb_mode=cfg.log.wandb_mode,
        config=cfg.to_dict(redact_secrets=True),
        use_tensorboard=cfg.log.use_tensorboard,
    )


def _start_rollout_side(
    cfg: Config, placement: Placement | None, num_rollout: int
) -> tuple[ActorHandle, ActorHandle]:
    """Start the engine fleet and the rollout manager (Ray actors, their constructors run meanwhile; the fleet in
    this process where it only starts and stops engines inside the ranks, `fleet_in_driver`, and the rollout
    manager on a thread of it with the synchronous driver, `rollout_in_driver`). The rollout side loads its
    tokenizer and prompts while the trainers and engines start; it gets the engines' URLs (`_connect`) once they
    answer."""
    if rollout_in_driver(cfg, placement):  # built on a thread of this process while the trainers start
        rollout: ActorHandle = ThreadActor(RolloutManager, cfg, in_driver=True)
    else:
        rollout = ray.remote(RolloutManager).options(num_cpus=0).remote(cfg)
    if fleet_in_driver(cfg, placement):  # it only starts and stops the engines inside the training ranks
        fleet = local_actor(EngineFleet, cfg, placement, num_rollout, in_driver=True)
    else:
        fleet = ray.remote(EngineFleet).options(num_cpus=0).remote(cfg, placement, num_rollout)
    return fleet, rollout


def rollout_in_driver(cfg: Config, placement: Placement | None) -> bool:
    """Whether the rollout manager runs on a thread of the driver's process (`ThreadActor`) instead of a Ray
    actor of its own (~100 MB PSS and ~1 CPU-s of start-up less on the CPU quickstart): where the engine fleet
    does (`fleet_in_driver`: CPU, colocated, the embedded engines inside the training ranks, no router, no fault
    tolerance), with the synchronous driver (`miles.train`: the rollout and the step take turns, so it takes no
    core from the driver's own work) on an instance this machine runs (not a cluster joined by RAY_ADDRESS). The
    asynchronous drivers (generation overlapping training), GPU, SGLang and clusters keep the actor."""
    from miles.train_async import OVERLAP_ENV

    return (
        fleet_in_driver(cfg, placement)
        and not cfg.rollout.fully_async
        and os.environ.get(OVERLAP_ENV) != "1"
        and not os.environ.get("RAY_ADDRESS")
    )


def _cpu_threads_env(cfg: Config, placement: Placement, num_actor: int) -> dict[str, str]:
    """On CPU, OMP_NUM_THREADS for the training ranks (`cpu_trainer_threads`; --train-env-vars may set it)."""
    if placement.use_gpu:
        return {}
    concurrent = 0 if cfg.cluster.colocate else len(placement.engine_bundles)
    threads = str(cpu_trainer_threads(num_actor, concurrent))
    from miles.train_async import OVERLAP_ENV

    # the asynchronous drivers: the engines generate while the ranks train, so they keep their cores (not fully
    # async with bound 0: no prompt starts before the refit after a step, so the engines wait, as in miles.train)
    overlaps = cfg.rollout.fully_async or os.environ.get(OVERLAP_ENV) == "1"
    if overlaps and not (cfg.rollout.fully_async and cfg.rollout.max_weight_staleness == 0):
        return {"OMP_NUM_THREADS": threads, "MILES_CPU_TRAIN_THREADS": threads}
    return {"OMP_NUM_THREADS": threads}  # (FSDP's set_cpu_threads then shares all cores out, as before)


def _start_trainers(
    cfg: Config, placement: Placement, num_actor: int, has_critic: bool, tracker: Tracker
) -> tuple[RayTrainGroup, RayTrainGroup | None, int]:
    """Build the actor's train group (and the critic's with PPO), loading --load when set: (actor, critic,
    the rollout they resume at)."""
    env_vars = {
        "HF_HUB_OFFLINE": "1",
        **progress_env(progress_enabled()),
        **_cpu_threads_env(cfg, placement, num_actor),
        **dict(cfg.cluster.train_env_vars),
    }
    train_group = RayTrainGroup(cfg, placement, num_actor, env_vars)
    start = train_group.init(with_ref=needs_reference_model(cfg))
    critic_group = None
    if has_critic:
        critic_group = RayTrainGroup(cfg, placement, num_actor, env_vars, role="critic")
        critic_start = critic_group.init(with_ref=False)
        if critic_start != start:
            raise RuntimeError(
                f"--load: the actor resumes at rollout {start} but the critic at {critic_start}"
            )
        if cfg.cluster.colocate:
            critic_group.sleep()  # the actor refits the engines next; the critic wakes to train
    if start > 0:
        tracker.resume_at(start)  # steps logged after the checkpoint ran again: keep each step once
    return train_group, critic_group, start


def _connect(
    cfg: Config,
    fleet: ActorHandle,
    rollout: ActorHandle,
    engines: tuple[str, list[str]] | None,
    train_group: RayTrainGroup | None,
    start: int,
) -> EngineSide:
    """Give the rollout manager the router's and engines' URLs (waiting for the engines unless `engines` has
    them already) and put its data cursor where the run starts."""
    timeout = float(cfg.train.train_timeout)
    router_url, engine_urls = engines or _engine_urls(fleet, timeout)
    ray_get(
        rollout.connect.remote(router_url, engine_urls),
        timeout,
        "starting the rollout manager (data, tokenizer)",
    )
    resume_rollout_side(cfg, rollout, train_group, start, timeout)
    return EngineSide(cfg=cfg, rollout=rollout, fleet=fleet, engine_urls=engine_urls)


def _ready(cfg: Config, num_actor: int, num_rollout: int, use_gpu: bool, start: int) -> ProgressBar:
    """Say the system is up; the driver's progress bar over the rollouts left."""
    logger.info(
        "system ready: %d training workers, %d rollout workers, colocate=%s, gpu=%s, start rollout %d",
        num_actor,
        num_rollout,
        cfg.cluster.colocate,
        use_gpu,
        start,
    )
    return progress_bar(cfg.rollout.num_rollout - start, "rollouts", unit="rollout")
