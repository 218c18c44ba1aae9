"""The training-backend contract (public).

A backend is a plain class registered in `miles.backends` under a name (`--train-backend NAME`). One instance runs
per training process; the Ray actor in `miles.ray.train_group` only sets up the environment and delegates here, so a
backend can be built and tested without Ray. Everything not listed below is private to the backend.
"""

from __future__ import annotations

import abc
from typing import Any

RolloutData = list[dict[str, Any]]
"""One DP rank's share of a rollout: per sample `tokens`, `response_length`, `loss_mask`, `rollout_log_probs`,
`reward`, `group_index`, `index`, `status` (see `miles.utils.types.Sample`)."""


class TrainBackend(abc.ABC):
    def __init__(self, config: Any, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size

    @abc.abstractmethod
    def init(self, role: str, with_ref: bool) -> int:
        """Process group, mesh, model (+ reference), optimizer, scheduler, resume. Returns the first rollout id."""

    @abc.abstractmethod
    def train(self, rollout_id: int, rollout_data: RolloutData) -> dict[str, float]:
        """Wake up if offloaded; pack; log-probs; loss; backward; optimizer steps. Returns reduced metrics."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Sharded checkpoint of model, optimizer, scheduler, RNG and counters, written atomically."""

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
    def update_weights(self, engine_urls: list[str], weight_version: str) -> None:
        """Refit the rollout engines with the current weights, in buckets."""
