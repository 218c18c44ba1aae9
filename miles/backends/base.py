"""The training-backend contract (public).

A backend is a plain class registered in `miles.backends` under a name (`--train-backend NAME`). One instance runs
per training process; the Ray actor in `miles.ray.train_group` only sets up the environment and delegates here, so a
backend can be built and tested without Ray. Everything not listed below is private to the backend.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from miles.config import Config


class TrainBackend(abc.ABC):
    def __init__(self, config: Config, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    def init(self, role: str, with_ref: bool) -> int:
        """Process group, mesh, model (+ reference), optimizer, scheduler, resume. Returns the first rollout id."""

    @abc.abstractmethod
    def train(self, rollout_id: int, samples: list[Sample], values: object = None) -> Mapping[str, object]:
        """Wake up if offloaded; pack; log-probs; loss; backward; optimizer steps. Returns reduced metrics
        (the critic role: ``{"metrics": ..., "values": B x [L_i]}``; the actor takes those `values` back for
        --advantage-estimator ppo).

        `samples` is this DP rank's share of the rollout, whole prompt groups: `Sample` records with token ids,
        the per-token loss mask (only mask-1 tokens are trained on), rollout log-probs and the trained reward
        (`Sample.scalar_reward()`)."""

    @abc.abstractmethod
    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        """Sharded checkpoint of model, optimizer, scheduler, RNG and counters, written atomically, with the
        driver's `extra_state` (plain data: the rollout's data cursor) stored beside them."""

    def resume_state(self) -> dict[str, JSON]:
        """The `extra_state` of the checkpoint `init` resumed from; {} for a fresh start."""
        return dict(getattr(self, "_resumed_extra_state", {}))

    @abc.abstractmethod
    def save_hf(self, rollout_id: int) -> None:
        """The policy as a HuggingFace directory (--save-hf), gathered without two full copies on one rank."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Move parameters and optimizer state off the accelerator (colocated mode)."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Move parameters and optimizer state back onto the accelerator."""

    @abc.abstractmethod
    def update_weights(
        self, engine_urls: list[str], weight_version: str, resume_tags: Sequence[str] = ()
    ) -> None:
        """Refit the rollout engines with the current weights, in buckets. `resume_tags`: memory the engines
        released for training, to resume (once, on every engine) before the weights move: the refit at the end
        of a train call (`miles.ray.colocate.RefitAfterTrain`)."""
