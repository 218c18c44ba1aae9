"""The training-backend contract (public): one protocol per role.

A backend registers, in `miles.backends`, a class per role under a name (`--train-backend NAME`): a
`PolicyBackend` (the 'actor' role: trains the policy and refits the rollout engines) and, for
--advantage-estimator ppo, a `ValueBackend` (the 'critic' role: trains a value model and returns its values).
One instance runs per training process; the Ray actor in `miles.ray.train_group` only sets up the environment and
delegates here, so a backend can be built and tested without Ray. Everything not listed below is private to the
backend. What crosses the Ray boundary is plain data (dicts, lists, floats).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from miles.config import Config


class ValueTrainResult(TypedDict):
    """What `ValueBackend.train` returns (a plain dict at run time, so it crosses Ray as it is)."""

    metrics: dict[str, float]  # reduced over the training ranks
    values: list[
        list[float]
    ]  # per sample (in the order given), per response token: the values before the update


class TrainRole(abc.ABC):
    """What every role's backend does: build, checkpoint, offload."""

    def __init__(self, config: Config, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    def init(self, role: str, with_ref: bool) -> int:
        """Process group, mesh, model (+ reference), optimizer, scheduler, resume. Returns the first rollout id."""

    @abc.abstractmethod
    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        """Sharded checkpoint of model, optimizer, scheduler, RNG and counters, written atomically, with the
        driver's `extra_state` (plain data: the rollout's data cursor) stored beside them."""

    @abc.abstractmethod
    def resume_state(self) -> dict[str, JSON]:
        """The `extra_state` of the checkpoint `init` resumed from; {} for a fresh start."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Move parameters and optimizer state off the accelerator (colocated mode)."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Move parameters and optimizer state back onto the accelerator."""


class PolicyBackend(TrainRole):
    """The 'actor' role: the policy, its reference model, the algorithm and the refit of the rollout engines."""

    @abc.abstractmethod
    def train(
        self, rollout_id: int, samples: list[Sample], values: list[list[float]] | None = None
    ) -> dict[str, float]:
        """Wake up if offloaded; pack; log-probs; loss; backward; optimizer steps. Returns reduced metrics.

        `samples` is this DP rank's share of the rollout, whole prompt groups: `Sample` records with token ids,
        the per-token loss mask (only mask-1 tokens are trained on), rollout log-probs and the trained reward
        (`Sample.scalar_reward()`). `values`: the critic's values of these samples (`ValueTrainResult.values`),
        for --advantage-estimator ppo."""

    @abc.abstractmethod
    def save_hf(self, rollout_id: int) -> None:
        """The policy as a HuggingFace directory (--save-hf), gathered without two full copies on one rank."""

    @abc.abstractmethod
    def update_weights(
        self,
        engine_urls: list[str],
        weight_version: str,
        resume_tags: Sequence[str] = (),
        flush_cache: bool = True,
    ) -> dict[str, float]:
        """Refit the rollout engines with the current weights, in buckets. `resume_tags`: memory the engines
        released for training, to resume (once, on every engine) before the weights move: the refit at the end
        of a train call (`miles.ray.colocate.RefitAfterTrain`). `flush_cache`: False when the engines hold
        requests paused in place (`miles.refit.refitter.Refitter.update`). Returns the refit's metrics on the rank that
        measured them (`perf/refit_checksum_*`, and `perf/refit_bytes`/`perf/refit_tensors_*` where
        the transport counts them; see `miles.refit.refitter.Refitter.metrics`), else {}."""


class ValueBackend(TrainRole):
    """The 'critic' role: a value model trained on the same samples, whose values feed the policy's GAE."""

    @abc.abstractmethod
    def train(self, rollout_id: int, samples: list[Sample]) -> ValueTrainResult:
        """Wake up if offloaded; the values of `samples` with the current weights (no grad), GAE returns from
        them, then the value loss's optimizer steps. Returns the metrics and those pre-update values."""
