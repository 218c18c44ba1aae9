"""Placement on a real Ray cluster of two fake 4-GPU nodes (two raylets on this host, `ray.cluster_utils.Cluster`):
for 1, 2 and 4 GPUs per engine, colocated and disaggregated, every engine is on one node, on GPUs of its own, and
colocated on its training ranks' GPUs; an engine of 8 GPUs, which would span the nodes, is refused."""

from __future__ import annotations

import pytest

from miles.ray.placement import PlacementError, create_placement
from tests.integration._placement_layouts import check_layout


@pytest.fixture(scope="module")
def two_fake_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 4})
    cluster.add_node(num_cpus=4, num_gpus=4)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("per_engine", [1, 2, 4])
def test_engines_stay_on_one_node_with_gpus_of_their_own(two_fake_nodes, per_engine, colocate):
    check_layout(8 if colocate else 4, 8 if colocate else 4, colocate, per_engine)


@pytest.mark.slow
@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "disaggregated"])
def test_engine_spanning_two_nodes_is_refused(two_fake_nodes, colocate):
    import ray

    placement = create_placement(0 if not colocate else 8, 8, colocate, use_gpu=True, timeout_s=120)
    try:
        nodes = {loc.node_id for loc in placement.locations or ()}
        assert len(nodes) == 2
        with pytest.raises(PlacementError, match=r"engine 0: its 8 GPUs .* span nodes"):
            placement.engine_gpus(8)
    finally:
        ray.util.remove_placement_group(placement.pg)
