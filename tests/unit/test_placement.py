"""Placement math without Ray: bundles sorted by (node, GPU id), handed out to training ranks and engines, and the
check an engine runs at start (`miles.ray.placement`).

The probe results are recorded as Ray reports them, shuffled the way Ray may map bundles to GPUs: a fake 8-GPU node
and a fake 2-node x 4-GPU layout, for 1, 2, 4 and 8 GPUs per engine, colocated and disaggregated. The same layouts
run on a real (fake-GPU) Ray instance in tests/integration/test_placement_ray.py.
"""

from __future__ import annotations

import random

import pytest

from miles.ray.placement import (
    BundleLocation,
    EngineGPUs,
    PlacementError,
    assign_bundles,
    bundle_order,
    check_engine_gpus,
    engine_gpu_plan,
    sglang_launch_gpus,
)

NODE_A, NODE_B = ("10.0.0.9", "a" * 56), ("10.0.0.10", "b" * 56)  # 10.0.0.9 sorts first as an address


def recorded(nodes: list[tuple[str, str]], gpus_per_node: int, seed: int) -> list[BundleLocation]:
    """Probe results of one bundle per GPU, in a shuffled bundle order (as Ray may hand them out)."""
    locs = [BundleLocation(ip, nid, str(g)) for ip, nid in nodes for g in range(gpus_per_node)]
    random.Random(seed).shuffle(locs)
    return locs


LAYOUTS = {"1x8": ([NODE_A], 8), "2x4": ([NODE_A, NODE_B], 4)}


def split(total: int, per_engine: int, colocate: bool) -> tuple[int, int]:
    """(training ranks, rollout GPUs) filling `total` GPUs: colocated all of them on both sides; disaggregated
    half and half, or all to the engines when one engine takes every GPU (a rollout-only run)."""
    if colocate:
        return total, total
    return (0, total) if per_engine == total else (total // 2, total // 2)


def start_engine(
    locs: list[BundleLocation],
    planned: EngineGPUs,
    kind: str = "sglang",
    sglang_args: dict | None = None,
    actor_cvd: str | None = None,
    ray_gpu: str | None = None,
    node_id: str | None = None,
) -> tuple[dict[str, str], list[str]]:
    """What an engine's actor sees on its first bundle (as Ray gives it), then the engine's own start check."""
    first = locs[planned.bundles[0]]
    return check_engine_gpus(
        planned,
        kind,
        sglang_args or {},
        [int(ray_gpu if ray_gpu is not None else first.gpu_id)],
        node_id if node_id is not None else first.node_id,
        actor_cvd,
    )


def assert_layout_sound(locs, actor_bundles, plan, per_engine, colocate):
    """Every engine's GPUs are distinct from every other's, on one node, contiguous, as launched equal to the plan
    (SGLang's TP rank k on visible device base_gpu_id + k), and colocated equal to its training ranks' GPUs."""
    seen: set[tuple[str, str]] = set()
    for planned in plan:
        where = [locs[b] for b in planned.bundles]
        assert len({w.node_id for w in where}) == 1
        ids = [int(w.gpu_id) for w in where]
        assert ids == list(range(ids[0], ids[0] + per_engine))  # contiguous, in TP-rank order
        for w in where:
            assert (w.node_id, w.gpu_id) not in seen
            seen.add((w.node_id, w.gpu_id))
        env, launched = start_engine(locs, planned)
        assert env == {"CUDA_VISIBLE_DEVICES": ",".join(planned.gpu_ids)}
        assert launched == list(planned.gpu_ids) == [w.gpu_id for w in where]
        assert sglang_launch_gpus(env["CUDA_VISIBLE_DEVICES"], 0, 1, per_engine) == launched
        if colocate:
            ranks = range(planned.engine_index * per_engine, (planned.engine_index + 1) * per_engine)
            assert [locs[actor_bundles[r]] for r in ranks] == where


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("per_engine", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sorted_placement_gives_each_engine_its_own_contiguous_gpus(layout, per_engine, colocate):
    nodes, per_node = LAYOUTS[layout]
    total = len(nodes) * per_node
    num_actor, num_rollout = split(total, per_engine, colocate)
    for seed in range(5):
        locs = recorded(nodes, per_node, seed)
        order = bundle_order(locs)
        assert [(locs[b].node_ip, int(locs[b].gpu_id)) for b in order] == sorted(
            ((ip, g) for ip, _ in nodes for g in range(per_node)),
            key=lambda t: (tuple(int(x) for x in t[0].split(".")), t[1]),
        )
        actor_bundles, engine_bundles = assign_bundles(order, num_actor, num_rollout, colocate)
        assert sorted(actor_bundles + ([] if colocate else engine_bundles)) == sorted(
            order[: len(actor_bundles) + (0 if colocate else len(engine_bundles))]
        )
        if per_engine > per_node:  # 8 GPUs per engine on 4-GPU nodes: refused, naming the engine and nodes
            with pytest.raises(PlacementError, match=r"engine 0: its 8 GPUs \(bundles .* span nodes"):
                engine_gpu_plan(locs, engine_bundles, actor_bundles, per_engine, colocate)
            continue
        plan = engine_gpu_plan(locs, engine_bundles, actor_bundles, per_engine, colocate)
        assert len(plan) == num_rollout // per_engine
        assert_layout_sound(locs, actor_bundles, plan, per_engine, colocate)
        if not colocate and num_actor:  # the engines have GPUs of their own
            trainer = {(locs[b].node_id, locs[b].gpu_id) for b in actor_bundles}
            assert not trainer & {(p.node_id, g) for p in plan for g in p.gpu_ids}


def test_without_sorting_the_same_probes_fail_the_plan():
    """Why the order matters: bundles in Ray's order put one engine on two nodes, or on non-adjacent GPUs."""
    locs = [BundleLocation(*NODE_A, "0"), BundleLocation(*NODE_B, "0"),
            BundleLocation(*NODE_A, "1"), BundleLocation(*NODE_B, "1")]  # fmt: skip
    with pytest.raises(PlacementError, match=r"engine 0: its 2 GPUs \(bundles \[0, 1\]"):
        engine_gpu_plan(locs, [0, 1, 2, 3], [0, 1, 2, 3], 2, colocate=True)
    order = bundle_order(locs)
    assert order == [0, 2, 1, 3]
    plan = engine_gpu_plan(locs, order, order, 2, colocate=True)
    assert [(p.node_ip, p.gpu_ids) for p in plan] == [("10.0.0.9", ("0", "1")), ("10.0.0.10", ("0", "1"))]


def test_gpu_ids_sort_as_numbers_and_uuids_as_text():
    locs = [BundleLocation(*NODE_A, g) for g in ("10", "9", "1", "0")]
    assert [locs[b].gpu_id for b in bundle_order(locs)] == ["0", "1", "9", "10"]
    uuids = [BundleLocation(*NODE_A, g) for g in ("GPU-b", "GPU-a")]
    assert [uuids[b].gpu_id for b in bundle_order(uuids)] == ["GPU-a", "GPU-b"]
    # raylets sharing an IP (a fake multi-node cluster on one host) are kept apart by node id
    same_ip = [BundleLocation("10.0.0.1", "z", "0"), BundleLocation("10.0.0.1", "y", "0"),
               BundleLocation("10.0.0.1", "z", "1"), BundleLocation("10.0.0.1", "y", "1")]  # fmt: skip
    assert bundle_order(same_ip) == [1, 3, 0, 2]


def test_two_engines_on_one_gpu_are_refused():
    locs = [BundleLocation(*NODE_A, "0"), BundleLocation(*NODE_A, "1"), BundleLocation(*NODE_A, "1")]
    with pytest.raises(PlacementError, match=r"engine 2 \(bundle 2\) and engine 1 both got 10.0.0.9 GPU 1"):
        engine_gpu_plan(locs, [0, 1, 2], [], 1, colocate=False)
    # within one engine too: two TP ranks on one GPU
    with pytest.raises(PlacementError, match=r"engine 0 \(bundle 2\) and engine 0 both got 10.0.0.9 GPU 1"):
        engine_gpu_plan(locs, [1, 2], [], 2, colocate=False)


def test_colocated_engine_on_other_gpus_than_its_training_ranks_is_refused():
    locs = recorded([NODE_A], 4, seed=0)
    order = bundle_order(locs)
    with pytest.raises(PlacementError, match=r"engine 0 .* but its training ranks \[0, 1\] are on"):
        engine_gpu_plan(locs, order, list(reversed(order)), 2, colocate=True)


def test_rollout_only_colocated_plan_has_no_training_ranks_to_match():
    locs = recorded([NODE_A], 4, seed=1)
    actor, engines = assign_bundles(bundle_order(locs), 0, 4, colocate=True)
    assert actor == [] and len(engine_gpu_plan(locs, engines, actor, 2, colocate=True)) == 2


def test_sglang_base_gpu_id_indexes_the_visible_devices():
    # SGLang 0.5.23 (entrypoints/engine.py): TP rank k runs on device base_gpu_id + k * gpu_id_step of the
    # devices it sees (an index into CUDA_VISIBLE_DEVICES, not a physical id)
    assert sglang_launch_gpus(None, 2, 1, 2) == ["2", "3"]
    assert sglang_launch_gpus("4,5,6,7", 1, 1, 2) == ["5", "6"]
    assert sglang_launch_gpus("4,5,6,7", 0, 2, 2) == ["4", "6"]
    with pytest.raises(PlacementError, match=r"needs visible devices \[5, 6\].*shows 4"):
        sglang_launch_gpus("4,5,6,7", 5, 1, 2)


ENGINE_1 = EngineGPUs(1, (6, 2), NODE_A[0], NODE_A[1], ("2", "3"))


def test_engine_start_sets_its_gpus_whatever_ray_made_visible():
    # bundle 6 holds GPU 2, bundle 2 GPU 3 (ENGINE_1's bundles)
    locs = [BundleLocation(*NODE_A, str(g)) for g in (7, 6, 3, 5, 4, 1, 2, 0)]
    # with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES the actor inherits the node's devices (unset, or a list);
    # without it Ray shows the actor its one GPU. The server sees the engine's GPUs in TP order either way.
    for actor_cvd in (None, "0,1,2,3,4,5,6,7", "2"):
        env, launched = start_engine(locs, ENGINE_1, actor_cvd=actor_cvd)
        assert env == {"CUDA_VISIBLE_DEVICES": "2,3"} and launched == ["2", "3"]
    # the old rule (base_gpu_id = Ray's GPU id on top of what Ray made visible) would index past "2"
    with pytest.raises(PlacementError):
        sglang_launch_gpus("2", 2, 1, 2)
    one = EngineGPUs(0, (6,), NODE_A[0], NODE_A[1], ("2",))
    assert start_engine(locs, one, kind="local", actor_cvd="2") == ({"CUDA_VISIBLE_DEVICES": "2"}, ["2"])


def test_embedded_engine_on_several_gpus_is_refused():
    locs = [BundleLocation(*NODE_A, str(g)) for g in range(8)]
    with pytest.raises(PlacementError, match="embedded engine runs on one GPU"):
        start_engine(locs, EngineGPUs(1, (2, 3), NODE_A[0], NODE_A[1], ("2", "3")), kind="local")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(ray_gpu="5"), r"actor \(on bundle 6\) GPU\(s\) \['5'\] on node aaaaaaaa, expected \['2'\]"),
        (dict(node_id="c" * 56), r"on node cccccccc, expected \['2'\] on node aaaaaaaa"),
        (dict(actor_cvd="4,5"), r"Ray gave its actor GPU 2, but the actor's CUDA_VISIBLE_DEVICES='4,5'"),
        (dict(sglang_args={"base_gpu_id": "1"}), r"needs visible devices \[1, 2\]"),
        (dict(sglang_args={"gpu_id_step": "2"}), r"needs visible devices \[0, 2\]"),
    ],
    ids=["ray-gpu", "node", "visible", "base-gpu-id", "gpu-id-step"],
)
def test_engine_start_mismatch_names_engine_bundles_and_gpus(override, match):
    locs = [BundleLocation(*NODE_A, str(g)) for g in (7, 6, 3, 5, 4, 1, 2, 0)]
    with pytest.raises(PlacementError, match=match) as err:
        start_engine(locs, ENGINE_1, **override)
    assert "engine 1 (bundles [6, 2] on 10.0.0.9)" in str(err.value)
    assert "expected GPUs ['2', '3']" in str(err.value)


def test_sglang_flag_override_that_moves_the_gpus_is_refused():
    locs = [BundleLocation(*NODE_A, str(g)) for g in range(8)]
    wide = EngineGPUs(0, (0, 1), NODE_A[0], NODE_A[1], ("0", "1"))
    assert start_engine(locs, wide, sglang_args={"base-gpu-id": "0"})[1] == ["0", "1"]
    with pytest.raises(PlacementError, match=r"expected GPUs \['0', '1'\]: base_gpu_id 1"):
        start_engine(locs, wide, sglang_args={"base-gpu-id": "1"})
