"""Who holds the memory when: the offload/onload choreography around training and refit.

Colocated mode alternates one set of devices between the engines and the trainer: the engines release weights and
KV cache before training, the trainer refits the engines' weights and then sleeps, and the engines re-create their
KV cache. Disaggregated mode keeps both resident, so every step here is a no-op except the refit itself.

SGLang 0.5.23 resumes only what was released (its scheduler dies with `KeyError: 'weights'` on a resume of a tag
it never released), so the choreography remembers which tags the engines released. The memory order at start-up
(`miles.ray.setup.build_system`): colocated engines start first, size their pools on devices the trainers do not
use yet, and release everything before the trainers load (the embedded engine on CPU loads while the trainers do,
and releases everything once both are up), so the start-up refit resumes what they released;
disaggregated engines hold their freshly loaded weights and the start-up refit resumes nothing. A release waits
for the engine to be idle (`miles.utils.engine_control_http.EngineMemoryControl.release_memory`).

Colocated on CPU (no accelerator: `trainer_offload=False`) the trainers' sleep and wake move nothing (their
parameters live in host memory either way), so the choreography skips those calls; the engines still release
everything while the trainer trains (their weights and KV cache are dropped, so a refit that misses a tensor
fails), and the refit resumes every released tag in one call before the weights move (the trainer's footprint is
the same asleep or awake, so resuming the KV cache before the refit raises no peak). Posting the release alongside
the train call instead was measured no faster on 2 cores: the engines' work then slows the training ranks. When
every engine is served from a training rank's process (`engines_in_trainers`, no critic), each rank releases its
own engine first thing in its train call, before it trains (all ranks agree first): the driver's release round
trip goes.

Wherever the refit is only "resume what was released, then move the weights" (CPU colocated, and disaggregated
placement, where nothing is released), the synchronous driver folds it into the train call (`refit_with_train`):
the trainers refit right after training, resuming the released tags first (rank 0, or each engine's own rank through
a weight window: `miles.refit.session.WeightUpdater.resume_engines`), which saves a Ray round
trip and the driver's resume call per step. The separate refit call stays where the driver has work between the
two (colocated GPU: the trainers sleep between the weights and the KV cache; a checkpoint due this step), with
the one-step-off driver (it waits for the in-flight rollout before refitting) and for the start-up refit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# in a train call's answer: the seconds its refit took (`RefitAfterTrain`; the driver counts them as `timing/refit`)
REFIT_SECONDS = "timing/refit_in_train_call"


@dataclass(frozen=True)
class RefitAfterTrain:
    """A refit the trainers run at the end of their train call: `resume_tags` are resumed on every engine first
    (none when nothing was released; see `WeightUpdater.resume_engines`), then the weights move to `engine_urls` as
    `weight_version`."""

    engine_urls: list[str]
    weight_version: str
    resume_tags: list[str]


class EngineMemory(Protocol):
    """Release/resume on every rollout engine (POST /release_memory_occupation, /resume_memory_occupation)."""

    def release_memory(self, tags: list[str]) -> None: ...

    def resume_memory(self, tags: list[str]) -> None: ...


class Trainer(Protocol):
    """The training side of the choreography (RayTrainGroup, or a plain object in tests)."""

    def update_weights(
        self, engine_urls: list[str], weight_version: str, flush_cache: bool = True
    ) -> dict[str, float] | None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


class MemoryChoreography:
    """Release before training, refit, resume after; tracks which tags the engines hold released."""

    def __init__(
        self,
        colocate: bool,
        trainer: Trainer,
        engines: EngineMemory,
        engine_urls: list[str],
        critic: Trainer | None = None,
        trainer_offload: bool = True,
        released: list[str] | tuple[str, ...] = (),
        keep_weights: bool = False,
        engines_in_trainers: bool = False,
    ) -> None:
        """`trainer_offload`: the trainers' sleep/wake move their state off/onto the devices the engines use
        (GPU); False on CPU, where both are no-ops (see the module docstring). `released`: the tags the engines
        already hold released (colocated start-up releases everything before the trainers load).
        `engines_in_trainers`: every engine is served from a training rank's process
        (`miles.ray.engine_fleet.engines_in_trainers`), so without a critic each rank releases its own engine
        first thing in its train call (`before_train`), not the driver over HTTP."""
        self.colocate = colocate
        self.trainer = trainer
        self.critic = critic  # --advantage-estimator ppo: trains before the actor, never awake with it
        self.engines = engines
        self.engine_urls = list(engine_urls)
        self.trainer_offload = trainer_offload
        self.released: set[str] = set(released)  # fresh engines hold everything
        # --lora-refit adapter: the engines keep the frozen base resident (a refit ships only the adapter)
        self.release_tags = [t for t in MEMORY_TAGS if not (keep_weights and t == "weights")]
        self.release_in_train = engines_in_trainers and colocate and critic is None and not trainer_offload

    def before_train(self) -> list[str]:
        """Colocated: the engines give the devices back (all tags), then the critic (when there is one, it
        trains first) or the trainer onloads (not on CPU: see the module docstring). Returns the tags the
        training ranks release themselves at the start of their train call, each its own engine
        (`engines_in_trainers`: a driver round trip less per step); else [] (released here, or nothing to)."""
        if not self.colocate:
            return []
        self.released = set(self.release_tags)
        if self.release_in_train:
            return list(self.release_tags)
        self.engines.release_memory(list(self.release_tags))
        if self.trainer_offload:
            (self.critic or self.trainer).wake_up()
        return []

    def critic_done(self) -> None:
        """Colocated: the critic has trained; it offloads and the actor onloads (one of them awake at a time)."""
        if self.colocate and self.critic is not None and self.trainer_offload:
            self.critic.sleep()
            self.trainer.wake_up()

    def refit_restarted(self, engine_urls: list[str], weight_version: str) -> None:
        """Refit engines the health monitor restarted: fresh servers hold the model's initial weights and every
        memory tag, so only the weights move (the trainer wakes for it and goes back to sleep on its own)."""
        if engine_urls:
            self.trainer.update_weights(list(engine_urls), weight_version)

    def refit_with_train(self, weight_version: str) -> RefitAfterTrain | None:
        """The refit as the train call's last part (see the module docstring), or None when it needs a call of
        its own (colocated with trainer offload: the trainer sleeps between the weights and the KV cache). After
        `before_train`; the engines count as holding every tag again (the trainers resume them)."""
        if self.colocate and self.trainer_offload:
            return None
        tags = [t for t in MEMORY_TAGS if t in self.released]
        self.released.clear()
        return RefitAfterTrain(list(self.engine_urls), weight_version, tags)

    def refit(self, weight_version: str, flush_cache: bool = True) -> dict[str, float]:
        """Push the trainer's weights to the engines and leave the engines ready to generate; the refit's
        metrics (`perf/refit_checksum_*`). `flush_cache`: False when the engines hold requests paused in
        place (--fully-async with --pause-generation-mode in_place: SGLang fails a flushing update then)."""
        if self.colocate and not self.trainer_offload:
            self._resume([t for t in MEMORY_TAGS if t in self.released])
            return self.trainer.update_weights(self.engine_urls, weight_version, flush_cache) or {}
        if self.colocate and "weights" in self.released:
            self._resume(["weights"])
        metrics = self.trainer.update_weights(self.engine_urls, weight_version, flush_cache) or {}
        if self.colocate:
            self.trainer.sleep()
            self._resume([t for t in MEMORY_TAGS if t in self.released])
        return metrics

    def _resume(self, tags: list[str]) -> None:
        if tags:
            self.engines.resume_memory(tags)
            self.released.difference_update(tags)


class TrainerOnly:
    """The choreography of --load-debug-rollout-data: no engines run, so there is nothing to release, resume or
    refit (the trainer wakes itself to train)."""

    def before_train(self) -> list[str]:
        return []

    def critic_done(self) -> None:
        pass

    def refit_with_train(self, weight_version: str) -> None:
        return None

    def refit(self, weight_version: str, flush_cache: bool = True) -> dict[str, float]:
        return {}
