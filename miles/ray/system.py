"""The running system the driver loops over, one class per run mode (`miles.ray.setup.build_system` builds it):

- `TrainSystem`: engines generate, the trainers train and refit them (the critic too with PPO);
- `RolloutOnlySystem` (--debug-rollout-only): engines generate, no trainers (the engines keep --hf-checkpoint);
- `ReplaySystem` (--load-debug-rollout-data): the trainers train on saved rollouts, no engines, nothing to refit.

Each has what its mode always has, typed as present; the driver tells them apart by `mode`."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import ray

from miles.ray.colocate import MemoryChoreography, TrainerOnly
from miles.ray.placement import Placement
from miles.ray.train_group import RayTrainGroup
from miles.ray.utils import LocalActor, ThreadActor, phase_timeout, ray_get, ready
from miles.utils.debug_data import load_rollout, save_rollout
from miles.utils.progress import ProgressBar
from miles.utils.seqlen_balancing import partition_samples_by_dp
from miles.utils.timer import Timer
from miles.utils.tracking import Tracker
from miles.utils.types import JSON, ActorHandle, Sample

if TYPE_CHECKING:
    from miles.config import Config

logger = logging.getLogger(__name__)

ROLLOUT_STATE_KEY = "rollout_state_json"  # the checkpoint's extra state: the runner's state_dict() as JSON


@dataclass(kw_only=True)
class EngineSide:
    """The rollout side of a run with engines: the rollout manager and the engine fleet (Ray actors), and the
    engines' URLs once they answered."""

    cfg: Config
    rollout: (
        ActorHandle  # Ray actor handle of RolloutManager, or the driver's `ThreadActor` (`rollout_in_driver`)
    )
    fleet: ActorHandle  # Ray actor handle of EngineFleet, or the driver's `LocalActor` (`fleet_in_driver`)
    engine_urls: list[str]

    @property
    def timeout(self) -> float:
        return float(self.cfg.rollout.rollout_request_timeout)

    @property
    def deadline(self) -> float | None:
        """--rollout-timeout; by default none with --use-fault-tolerance (each request has its deadline and dead
        engines come back), else twice the request deadline per wave of requests the engines can hold at once."""
        r = self.cfg.rollout
        if r.rollout_timeout is not None:
            return float(r.rollout_timeout)
        if self.cfg.cluster.use_fault_tolerance:
            return None
        requests = r.over_sampling_batch_size * r.n_samples_per_prompt
        waves = math.ceil(requests / (self.cfg.engine.engine_max_running_requests * len(self.engine_urls)))
        return 2 * self.timeout * max(1, waves)

    def generate(
        self, rollout_id: int, refit_restarted: Callable[[list[str]], None] | None = None
    ) -> tuple[list[Sample], dict[str, float]]:
        """Rollout `rollout_id` from the engines (saved with --save-debug-rollout-data as the trainer receives
        it). Meanwhile put the engines the health monitor restarted back behind the router, refitted first by
        `refit_restarted` when there are trainers (else they keep --hf-checkpoint). Polls once a second, so
        Ctrl-C is prompt. Without --use-fault-tolerance nothing restarts engines: no health-monitor calls."""
        phase = f"rollout {rollout_id}"
        watch = self.cfg.cluster.use_fault_tolerance  # else the fleet has no health monitor to ask
        if watch:
            ray_get(self.fleet.start_watch.remote(), 60, f"{phase}: start engine health checks")
        ref = self.rollout.generate.remote(rollout_id)
        limit = self.deadline
        deadline = None if limit is None else time.monotonic() + limit
        while not ready(ref, timeout=1.0):
            if watch:
                self._readmit(
                    ray_get(self.fleet.take_restarted.remote(), 60, phase), rollout_id, refit_restarted
                )
            if deadline is not None and time.monotonic() > deadline:
                error = phase_timeout(  # the stacks are dumped before the cancel unwinds them
                    f"timed out after {limit:.0f}s waiting for phase '{phase}' (--rollout-timeout)",
                    "the rollout manager (generate)",
                )
                if not isinstance(
                    self.rollout, ThreadActor
                ):  # else nothing can stop its thread: the run ends
                    ray.cancel(ref, force=False)
                raise error
        if watch:
            restarted = ray_get(  # a restart in progress loads a model: as long as engine start-up may take
                self.fleet.stop_watch.remote(),
                float(self.cfg.train.train_timeout),
                f"{phase}: engine restarts",
            )
            self._readmit(restarted, rollout_id, refit_restarted)
        samples, metrics = ray_get(ref, 60, phase)
        dbg = self.cfg.debug
        if dbg.save_debug_rollout_data:
            save_rollout(
                dbg.save_debug_rollout_data, rollout_id, samples, metrics, "--save-debug-rollout-data"
            )
        return samples, metrics

    def _readmit(self, urls: list[str], rollout_id: int, refit: Callable[[list[str]], None] | None) -> None:
        if urls:
            if refit is not None:
                refit(urls)
            ray_get(
                self.fleet.readmit.remote(urls), self.timeout, f"rollout {rollout_id}: router re-admission"
            )

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return ray_get(self.rollout.eval.remote(rollout_id), self.timeout, f"eval after rollout {rollout_id}")

    def checkpoint_state(self, rollout_id: int) -> dict[str, JSON]:
        """The rollout side's state (data cursor, partial-rollout buffer) for the trainer's checkpoint."""
        state = ray_get(
            self.rollout.state_dict.remote(rollout_id),
            self.timeout,
            f"save checkpoint {rollout_id}: rollout state",
        )
        return {ROLLOUT_STATE_KEY: json.dumps(state)}

    def stop(self, fast: bool) -> None:
        """Drain the engines and the router; `fast` (Ctrl-C) kills the engines instead."""
        if fast:
            ray_get(self.fleet.kill.remote(), 8, "killing the engines (Ctrl-C)")
        else:
            ray_get(self.fleet.shutdown.remote(), 120, "shutting down the engines")


@dataclass(kw_only=True)
class _Run:
    """What every run mode has: the config, the tracker, the driver's timer and progress bar, the first rollout."""

    cfg: Config
    tracker: Tracker
    start_rollout_id: int
    progress: ProgressBar  # the driver's bar over rollouts (a no-op unless progress bars are on)
    owns_ray: bool = True  # this run started Ray: shutdown stops it; else it removes what the run created
    timer: Timer = field(default_factory=Timer)

    def _shutdown(
        self,
        fast: bool,
        engines: EngineSide | None,
        groups: Sequence[RayTrainGroup | None],
        placement: Placement | None,
    ) -> None:
        """Stop engines, router, trackers, trainers and Ray; `fast` (Ctrl-C) kills the engines instead of draining
        them. A Ray instance this run did not start keeps running: this run's actors and placement group go."""
        try:
            if engines is not None:
                engines.stop(fast)
        finally:
            if engines is not None and isinstance(engines.rollout, ThreadActor):  # it lives in this process
                engines.rollout.stop(timeout=2.0 if fast else 10.0, last="close")
            self.progress.close()
            self.tracker.close()
            for group in groups:
                if group is not None:  # a normal exit first: a SIGKILLed worker leaves its /dev/shm files
                    group.shutdown(grace_s=2.0 if fast else 10.0)
            if self.owns_ray:
                ray.shutdown()
            else:  # the training workers have ended; the engine actors are the fleet's: they go with it
                if engines is not None:  # the rollout manager and the fleet: unless they live in this process
                    if not isinstance(engines.rollout, ThreadActor):
                        ray.kill(engines.rollout)
                    if not isinstance(engines.fleet, LocalActor):
                        ray.kill(engines.fleet)
                if placement is not None:
                    ray.util.remove_placement_group(placement.pg)


@dataclass(kw_only=True)
class _Training(_Run):
    """A run with trainers: the actor's train group and, with --advantage-estimator ppo, the critic's."""

    train_group: RayTrainGroup
    critic_group: RayTrainGroup | None  # --advantage-estimator ppo: the value model's train group
    placement: Placement

    def split_by_dp(self, samples: list[Sample]) -> list[list[Sample]]:
        """Split a rollout across DP ranks, keeping prompt groups whole (balanced by tokens with --balance-data)."""
        parts = partition_samples_by_dp(
            [len(s.tokens) for s in samples],
            [s.group_index for s in samples],
            self.train_group.dp_size,
            balance=self.cfg.train.balance_data,
        )
        return [[samples[i] for i in part] for part in parts]

    def _save_critic(self, rollout_id: int) -> None:
        """Before the actor's: a resumable actor checkpoint implies a critic one."""
        if self.critic_group is not None:
            self.critic_group.save(rollout_id)


@dataclass(kw_only=True)
class TrainSystem(_Training):
    """Engines, router, rollout manager and trainers: the run that trains."""

    mode: ClassVar[Literal["train"]] = "train"
    engines: EngineSide
    choreography: MemoryChoreography

    @property
    def rollout_deadline(self) -> float | None:
        return self.engines.deadline

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Rollout `rollout_id`; engines the health monitor restarted meanwhile are refitted with this rollout's
        weight version before they rejoin."""

        def refit(urls: list[str]) -> None:
            logger.warning("refitting restarted engine(s) %s with weight version %d", urls, rollout_id)
            self.choreography.refit_restarted(urls, weight_version=str(rollout_id))

        return self.engines.generate(rollout_id, refit)

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return self.engines.evaluate(rollout_id)

    def save(self, rollout_id: int) -> None:
        """Checkpoint the trainers with the rollout side's state (data cursor, partial-rollout buffer)."""
        self._save_critic(rollout_id)
        self.train_group.save(rollout_id, self.engines.checkpoint_state(rollout_id))

    def shutdown(self, fast: bool = False) -> None:
        self._shutdown(fast, self.engines, (self.train_group, self.critic_group), self.placement)


@dataclass(kw_only=True)
class RolloutOnlySystem(_Run):
    """--debug-rollout-only: engines, router and rollout manager, no trainers (the engines keep the
    --hf-checkpoint weights; restarted engines load them again)."""

    mode: ClassVar[Literal["rollout_only"]] = "rollout_only"
    engines: EngineSide
    placement: Placement | None  # None on external engines: nothing to place

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        return self.engines.generate(rollout_id)

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return self.engines.evaluate(rollout_id)

    def shutdown(self, fast: bool = False) -> None:
        self._shutdown(fast, self.engines, (), self.placement)


@dataclass(kw_only=True)
class ReplaySystem(_Training):
    """--load-debug-rollout-data: the trainers train on rollouts saved by --save-debug-rollout-data; no engines
    start and nothing is refit."""

    mode: ClassVar[Literal["replay"]] = "replay"
    rollouts: str  # --load-debug-rollout-data
    choreography: TrainerOnly

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Rollout `rollout_id` read back as the trainer received it when it was saved."""
        return load_rollout(self.rollouts, rollout_id, "--load-debug-rollout-data")

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        raise RuntimeError(
            "validation refuses --eval-interval with --load-debug-rollout-data (no engines run)"
        )

    def save(self, rollout_id: int) -> None:
        """Checkpoint the trainers (no rollout side: its state is the saved rollouts)."""
        self._save_critic(rollout_id)
        self.train_group.save(rollout_id, {})

    def shutdown(self, fast: bool = False) -> None:
        self._shutdown(fast, None, (self.train_group, self.critic_group), self.placement)


System = TrainSystem | RolloutOnlySystem | ReplaySystem
TrainingSystem = TrainSystem | ReplaySystem  # a run with trainers
