"""Placement groups for training actors and rollout engines.

One bundle per worker. With GPUs a bundle is {GPU: 1, CPU: 1}; without, it is {CPU: 1} and the `--*-num-gpus*`
flags count CPU worker processes. Colocated mode shares one set of bundles between the training actors and the
engines (each takes a fraction of the bundle); disaggregated mode gives the engines bundles of their own after the
training ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.ray.utils import ray_get

# Fractions of a shared bundle in colocated mode: both fit in one bundle at once.
COLOCATED_ACTOR_SHARE = 0.4
COLOCATED_ENGINE_SHARE = 0.2
# The critic (--advantage-estimator ppo) shares the training bundles: colocated it takes what is left of a
# bundle; disaggregated, actor and critic split the training bundles in half.
COLOCATED_CRITIC_SHARE = 0.4
DISAGGREGATED_TRAIN_SHARE_WITH_CRITIC = 0.5


@dataclass(frozen=True)
class Placement:
    pg: PlacementGroup
    use_gpu: bool
    actor_bundles: list[int]  # bundle index of training rank i
    engine_bundles: list[
        int
    ]  # bundle index of rollout worker j (one engine spans num_gpus_per_engine of them)
    colocate: bool
    has_critic: bool = False  # a critic train group shares the training bundles

    def actor_options(self, rank: int) -> dict:
        return self.worker_options("actor", rank)

    def worker_options(self, role: str, rank: int) -> dict:
        """Ray options of training rank `rank` of train group `role` ("actor" or "critic")."""
        if role not in ("actor", "critic") or (role == "critic" and not self.has_critic):
            raise ValueError(f"no {role!r} train group in this placement (has_critic={self.has_critic})")
        if self.colocate:
            share = COLOCATED_ACTOR_SHARE if role == "actor" else COLOCATED_CRITIC_SHARE
        else:
            share = DISAGGREGATED_TRAIN_SHARE_WITH_CRITIC if self.has_critic else 1.0
        return self._options(self.actor_bundles[rank], share)

    def engine_options(self, engine_index: int, gpus_per_engine: int) -> dict:
        share = COLOCATED_ENGINE_SHARE if self.colocate else 1.0
        return self._options(self.engine_bundles[engine_index * gpus_per_engine], share)

    def _options(self, bundle: int, share: float) -> dict:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle
        )
        if self.use_gpu:
            return {"num_gpus": share, "num_cpus": share, "scheduling_strategy": strategy}
        return {"num_cpus": share, "scheduling_strategy": strategy}


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def create_placement(
    num_actor_workers: int,
    num_rollout_workers: int,
    colocate: bool,
    use_gpu: bool,
    timeout_s: float = 300.0,
    has_critic: bool = False,
) -> Placement:
    """Reserve bundles for `num_actor_workers` training ranks and `num_rollout_workers` engine workers (either may
    be 0 for replay debugging: a trainer without engines, or engines without a trainer)."""
    if min(num_actor_workers, num_rollout_workers) < 0 or num_actor_workers + num_rollout_workers < 1:
        raise ValueError(
            f"need training or rollout workers, got {num_actor_workers} and {num_rollout_workers}"
        )
    if colocate and num_actor_workers and num_rollout_workers > num_actor_workers:
        raise ValueError(
            f"--colocate shares bundles, so --rollout-num-gpus ({num_rollout_workers}) cannot exceed the "
            f"training workers ({num_actor_workers})"
        )
    total = (
        max(num_actor_workers, num_rollout_workers) if colocate else num_actor_workers + num_rollout_workers
    )
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(total)], strategy="PACK")
    ray_get(pg.ready(), timeout_s, phase=f"reserving {total} placement-group bundles of {bundle}")
    actor_bundles = list(range(num_actor_workers))
    if colocate:
        engine_bundles = list(range(num_rollout_workers))
    else:
        engine_bundles = list(range(num_actor_workers, num_actor_workers + num_rollout_workers))
    return Placement(pg, use_gpu, actor_bundles, engine_bundles, colocate, has_critic)
