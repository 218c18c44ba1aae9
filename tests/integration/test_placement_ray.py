"""Placement on a real Ray instance with a fake 8-GPU node (`ray.init(num_gpus=8)` hands out GPU ids without GPUs):
for 1, 2, 4 and 8 GPUs per engine, colocated and disaggregated, every engine's GPUs (as its actor sets them up for
the server) are its own, contiguous, and colocated the GPUs of its training ranks. The placement math itself is
tested without Ray in tests/unit/test_placement.py; two nodes in test_placement_ray_two_nodes.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles.ray.placement import EngineGPUs, PlacementError, create_placement
from tests.integration._placement_layouts import check_layout, engine_actors


@pytest.fixture(scope="module")
def fake_gpu_node():
    import ray

    ray.init(num_cpus=8, num_gpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("per_engine", [1, 2, 4, 8])
def test_engines_get_distinct_contiguous_gpus(fake_gpu_node, per_engine, colocate):
    # disaggregated: half the GPUs train, half serve; one engine of 8 GPUs takes the node (a rollout-only run)
    num_actor, num_rollout = (8, 8) if colocate else ((0, 8) if per_engine == 8 else (4, 4))
    check_layout(num_actor, num_rollout, colocate, per_engine)


@pytest.mark.slow
def test_engine_started_on_other_gpus_than_planned_refuses(fake_gpu_node):
    import ray

    placement = create_placement(4, 4, colocate=True, use_gpu=True, timeout_s=120)
    try:
        plans = placement.engine_gpus(2)
        assert plans is not None
        wrong = EngineGPUs(0, plans[1].bundles, plans[1].node_ip, plans[1].node_id, plans[1].gpu_ids)
        (actor,) = engine_actors(placement, 1, 2, [wrong])  # engine 0's bundle, engine 1's GPUs
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(actor.placed_gpus.remote())
        assert isinstance(err.value.cause, PlacementError)
        assert f"engine 0 (bundles {list(plans[1].bundles)}" in str(err.value.cause)
        assert f"expected GPUs {list(plans[1].gpu_ids)}" in str(err.value.cause)
        ray.kill(actor)
    finally:
        ray.util.remove_placement_group(placement.pg)


def test_placement_math_imports_without_ray():
    """The placement math is importable (so testable) without Ray: ray is imported only to make a group."""
    code = "import sys, miles.ray.placement; assert 'ray' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ}, timeout=120)
