"""Builds the running system for the driver: Ray, placement, training group, engine fleet, rollout manager,
tracking."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from miles.ray.colocate import MEMORY_TAGS, MemoryChoreography, TrainerOnly
from miles.ray.engine_fleet import EngineFleet
from miles.ray.placement import Placement, cluster_has_gpus, create_placement
from miles.ray.rollout_manager import RolloutManager
from miles.ray.train_group import RayTrainGroup
from miles.ray.utils import init_ray, phase_timeout, ray_get
from miles.utils.debug_data import load_rollout, save_rollout
from miles.utils.engine_http import EngineMemoryControl
from miles.utils.progress import ProgressBar, progress_bar, progress_enabled, progress_env
from miles.utils.seqlen_balancing import partition_samples_by_dp
from miles.utils.timer import Timer
from miles.utils.tracking import Tracker
from miles.utils.types import ActorHandle, Sample

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


@dataclass
class System:
    cfg: Config
    train_group: RayTrainGroup | None  # None with --debug-rollout-only
    rollout: ActorHandle  # Ray actor handle of RolloutManager; None with --load-debug-rollout-data
    fleet: ActorHandle  # Ray actor handle of EngineFleet; None with --load-debug-rollout-data
    choreography: MemoryChoreography | TrainerOnly | None  # None with --debug-rollout-only
    tracker: Tracker
    timer: Timer
    start_rollout_id: int
    progress: ProgressBar  # the driver's bar over rollouts (a no-op unless progress bars are on)

    num_engines: int = 1
    critic_group: RayTrainGroup | None = None  # --advantage-estimator ppo: the value model's train group
    placement: Placement | None = None
    owns_ray: bool = True  # this run started Ray: shutdown stops it; else it removes what the run created

    @property
    def trainers(self) -> RayTrainGroup:
        """The training group (a run with --debug-rollout-only has none and never asks for it)."""
        assert self.train_group is not None, "--debug-rollout-only starts no trainers"
        return self.train_group

    @property
    def timeout(self) -> float:
        return float(self.cfg.rollout.rollout_request_timeout)

    @property
    def rollout_deadline(self) -> float | None:
        """--rollout-timeout; by default none with --use-fault-tolerance (each request has its deadline and dead
        engines come back), else twice the request deadline per wave of requests the engines can hold at once."""
        r = self.cfg.rollout
        if r.rollout_timeout is not None:
            return float(r.rollout_timeout)
        if self.cfg.cluster.use_fault_tolerance:
            return None
        requests = r.over_sampling_batch_size * r.n_samples_per_prompt
        waves = math.ceil(requests / (self.cfg.engine.engine_max_running_requests * self.num_engines))
        return 2 * self.timeout * max(1, waves)

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Rollout `rollout_id` from the engines, or read back with --load-debug-rollout-data (saved with
        --save-debug-rollout-data as the trainer receives it). Meanwhile refit the engines the health monitor
        restarted (with this rollout's weight version) and put them back behind the router. Polls once a second,
        so Ctrl-C is prompt. Without --use-fault-tolerance nothing restarts engines: no health-monitor calls."""
        dbg = self.cfg.debug
        if dbg.load_debug_rollout_data:
            return load_rollout(dbg.load_debug_rollout_data, rollout_id, "--load-debug-rollout-data")
        phase = f"rollout {rollout_id}"
        watch = self.cfg.cluster.use_fault_tolerance  # else the fleet has no health monitor to ask
        if watch:
            ray_get(self.fleet.start_watch.remote(), 60, f"{phase}: start engine health checks")
        ref = self.rollout.generate.remote(rollout_id)
        limit = self.rollout_deadline
        deadline = None if limit is None else time.monotonic() + limit
        while not ray.wait([ref], timeout=1.0)[0]:
            if watch:
                self._refit_restarted(ray_get(self.fleet.take_restarted.remote(), 60, phase), rollout_id)
            if deadline is not None and time.monotonic() > deadline:
                error = phase_timeout(  # the stacks are dumped before the cancel unwinds them
                    f"timed out after {limit:.0f}s waiting for phase '{phase}' (--rollout-timeout)",
                    "the rollout manager (generate)",
                )
                ray.cancel(ref, force=False)
                raise error
        if watch:
            restarted = ray_get(  # a restart in progress loads a model: as long as engine start-up may take
                self.fleet.stop_watch.remote(),
                float(self.cfg.train.train_timeout),
                f"{phase}: engine restarts",
            )
            self._refit_restarted(restarted, rollout_id)
        samples, metrics = ray_get(ref, 60, phase)
        if dbg.save_debug_rollout_data:
            save_rollout(
                dbg.save_debug_rollout_data, rollout_id, samples, metrics, "--save-debug-rollout-data"
            )
        return samples, metrics

    def _refit_restarted(self, urls: list[str], rollout_id: int) -> None:
        if urls:
            if self.choreography is not None:  # --debug-rollout-only: restarted engines load --hf-checkpoint
                assert isinstance(self.choreography, MemoryChoreography), "replayed rollouts start no engines"
                logger.warning("refitting restarted engine(s) %s with weight version %d", urls, rollout_id)
                self.choreography.refit_restarted(urls, weight_version=str(rollout_id))
            ray_get(
                self.fleet.readmit.remote(urls), self.timeout, f"rollout {rollout_id}: router re-admission"
            )

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return ray_get(self.rollout.eval.remote(rollout_id), self.timeout, f"eval after rollout {rollout_id}")

    def save(self, rollout_id: int) -> None:
        """Checkpoint the trainer with the rollout side's state (data cursor, partial-rollout buffer; none when
        replaying saved rollouts)."""
        if (
            self.critic_group is not None
        ):  # before the actor: a resumable actor checkpoint implies a critic one
            self.critic_group.save(rollout_id)
        if self.rollout is None:
            self.trainers.save(rollout_id, {})
            return
        state = ray_get(
            self.rollout.state_dict.remote(rollout_id),
            self.timeout,
            f"save checkpoint {rollout_id}: rollout state",
        )
        self.trainers.save(rollout_id, {ROLLOUT_STATE_KEY: json.dumps(state)})

    def split_by_dp(self, samples: list[Sample]) -> list[list[Sample]]:
        """Split a rollout across DP ranks, keeping prompt groups whole (balanced by tokens with --balance-data)."""
        parts = partition_samples_by_dp(
            [len(s.tokens) for s in samples],
            [s.group_index for s in samples],
            self.trainers.dp_size,
            balance=self.cfg.train.balance_data,
        )
        return [[samples[i] for i in part] for part in parts]

    def shutdown(self, fast: bool = False) -> None:
        """Stop engines, router, trackers and Ray; `fast` (Ctrl-C) kills the engines instead of draining them."""
        try:
            if self.fleet is not None and fast:
                ray_get(self.fleet.kill.remote(), 8, "killing the engines (Ctrl-C)")
            elif self.fleet is not None:
                ray_get(self.fleet.shutdown.remote(), 120, "shutting down the engines")
        finally:
            self.progress.close()
            self.tracker.close()
            for group in (self.train_group, self.critic_group):
                if group is not None:  # a normal exit first: a SIGKILLed worker leaves its /dev/shm files
                    group.shutdown(grace_s=2.0 if fast else 10.0)
            if self.owns_ray:
                ray.shutdown()
            else:
                self.release_ray_resources()

    def release_ray_resources(self) -> None:
        """Kill this run's remaining actors and free its placement group, leaving the Ray instance (not ours)
        running. The training workers have ended in `shutdown`; the engine actors are the fleet's: they go with it."""
        for actor in (self.rollout, self.fleet):
            if actor is not None:
                ray.kill(actor)
        if self.placement is not None:
            ray.util.remove_placement_group(self.placement.pg)


ROLLOUT_STATE_KEY = "rollout_state_json"  # the checkpoint's extra state: the runner's state_dict() as JSON


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

    Colocated, the engines start first and release their memory before the trainers load (the memory order:
    engines sized on free devices, trainers after); disaggregated, engines and trainers start at once.

    Replay debugging leaves a side out: --load-debug-rollout-data starts no engines (and refits nothing),
    --debug-rollout-only starts no trainers (the engines keep the --hf-checkpoint weights)."""
    cfg = with_run_engine_key(cfg)
    num_actor, num_rollout = worker_counts(cfg)
    replay, rollout_only = cfg.debug.load_debug_rollout_data is not None, cfg.debug.debug_rollout_only
    num_rollout = 0 if replay else num_rollout
    num_actor = 0 if rollout_only else num_actor
    colocate = cfg.cluster.colocate
    owns_ray = init_ray(min_cpus=(max(num_actor, num_rollout) if colocate else num_actor + num_rollout) + 1)
    use_gpu = cluster_has_gpus()
    check_external_refit(cfg, use_gpu, num_actor)
    has_critic = cfg.algo.advantage_estimator == "ppo" and not rollout_only
    # nothing to place: a rollout-only run on external engines
    placement = (
        create_placement(num_actor, num_rollout, colocate, use_gpu, has_critic=has_critic)
        if num_actor + num_rollout
        else None
    )
    if placement is not None and num_rollout:
        check_engine_host_reachable(cfg.engine.engine_host, placement)
    timeout = float(cfg.train.train_timeout)

    tracker = Tracker(
        cfg.log.run_dir,
        use_wandb=cfg.log.use_wandb,
        wandb_project=cfg.log.wandb_project,
        wandb_group=cfg.log.wandb_group,
        wandb_key=cfg.log.wandb_key,
        wandb_mode=cfg.log.wandb_mode,
        config=cfg.to_dict(redact_secrets=True),
        use_tensorboard=cfg.log.use_tensorboard,
    )
    fleet = (
        None if replay else ray.remote(EngineFleet).options(num_cpus=0).remote(cfg, placement, num_rollout)
    )
    # the rollout side loads its tokenizer and prompts while the trainers and engines start; it gets the
    # engines' URLs (connect) once they answer
    rollout = None if replay else ray.remote(RolloutManager).options(num_cpus=0).remote(cfg)
    engines: tuple[str, list[str]] | None = None  # (router URL, engine URLs) once the engines answer
    released: list[str] = []  # the memory tags the engines hold released when the choreography starts
    if colocate and fleet is not None and not rollout_only:
        # the memory order of colocation: the engines size their memory pools (--sglang-mem-fraction-static is a
        # fraction of the memory free when they start) on devices the trainers do not use yet, give it all back,
        # and only then do the trainers load; disaggregated, both start at once
        engines = _engine_urls(fleet, timeout)
        EngineMemoryControl(
            engines[1], cfg.engine.engine_api_key, float(cfg.rollout.rollout_request_timeout)
        ).release_memory(list(MEMORY_TAGS))
        released = list(MEMORY_TAGS)
        logger.info(
            "colocated: %d engine(s) started and released their memory; the trainers load now",
            len(engines[1]),
        )
    train_group, critic_group, start = None, None, 0
    if not rollout_only:
        env_vars = {
            "HF_HUB_OFFLINE": "1",
            **progress_env(progress_enabled()),
            **dict(cfg.cluster.train_env_vars),
        }
        assert placement is not None  # training workers were placed
        train_group = RayTrainGroup(cfg, placement, num_actor, env_vars)
        start = train_group.init(with_ref=needs_reference_model(cfg))
        if has_critic:
            critic_group = RayTrainGroup(cfg, placement, num_actor, env_vars, role="critic")
            critic_start = critic_group.init(with_ref=False)
            if critic_start != start:
                raise RuntimeError(
                    f"--load: the actor resumes at rollout {start} but the critic at {critic_start}"
                )
            if colocate:
                critic_group.sleep()  # the actor refits the engines next; the critic wakes to train
    if start > 0:
        tracker.resume_at(start)  # steps logged after the checkpoint ran again: keep each step once
    engine_urls: list[str] = []
    choreography: MemoryChoreography | TrainerOnly | None = None
    if replay:
        choreography = TrainerOnly()
    else:
        assert fleet is not None and rollout is not None  # started above unless replaying
        router_url, engine_urls = engines or _engine_urls(fleet, timeout)
        ray_get(
            rollout.connect.remote(router_url, engine_urls),
            timeout,
            "starting the rollout manager (data, tokenizer)",
        )
        resume_rollout_side(cfg, rollout, train_group, start, timeout)
    if train_group is not None and fleet is not None:
        choreography = MemoryChoreography(
            colocate,
            train_group,
            EngineMemoryControl(
                engine_urls, cfg.engine.engine_api_key, float(cfg.rollout.rollout_request_timeout)
            ),
            engine_urls,
            critic=critic_group,
            trainer_offload=use_gpu,  # on CPU the trainers' sleep/wake move nothing
            released=released,
        )
        # engines start from the trainer's (possibly resumed) weights; fresh engines released nothing to resume
        choreography.refit(weight_version=str(start))
    logger.info(
        "system ready: %d training workers, %d rollout workers, colocate=%s, gpu=%s, start rollout %d",
        num_actor,
        num_rollout,
        colocate,
        use_gpu,
        start,
    )
    bar = progress_bar(cfg.rollout.num_rollout - start, "rollouts", unit="rollout")
    return System(
        cfg,
        train_group,
        rollout,
        fleet,
        choreography,
        tracker,
        Timer(),
        start,
        bar,
        num_engines=len(engine_urls),
        critic_group=critic_group,
        placement=placement,
        owns_ray=owns_ray,
    )
