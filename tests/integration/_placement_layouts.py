"""Shared by the fake-GPU Ray placement tests: place one layout on the running Ray instance and check what Ray gave
every training rank and engine (`miles.ray.placement`)."""

from __future__ import annotations

import ray

from miles.engines.sglang_engine import ENGINE_ACTOR_RUNTIME_ENV, make_engine_actor_class
from miles.ray.placement import BundleLocation, Placement, create_placement


@ray.remote(max_calls=0)  # touches no GPU: one worker may answer for several ranks
def _where() -> tuple[str, str, list[str]]:
    return (
        ray.util.get_node_ip_address(),
        ray.get_runtime_context().get_node_id(),
        [str(g) for g in ray.get_gpu_ids()],
    )


def trainer_gpus(placement: Placement, num_actor: int) -> list[BundleLocation]:
    """Where each training rank runs, asked with the options its actor gets (`Placement.worker_options`)."""
    answers = ray.get(
        [_where.options(**placement.worker_options("actor", r)).remote() for r in range(num_actor)]
    )
    assert all(len(gpus) == 1 for _, _, gpus in answers), answers
    return [BundleLocation(ip, node, gpus[0]) for ip, node, gpus in answers]


def engine_actors(placement: Placement, num_engines: int, per_engine: int, plans: list) -> list:
    """Real engine actors (`RolloutEngineActor`, SGLang kind, not launched) on the engines' bundles, given `plans`."""
    cls = make_engine_actor_class()
    return [
        cls.options(**placement.engine_options(i, per_engine), runtime_env=ENGINE_ACTOR_RUNTIME_ENV).remote(
            gpus=plans[i], model_path="unused", kind="sglang", tp_size=per_engine
        )
        for i in range(num_engines)
    ]


def check_layout(num_actor: int, num_rollout: int, colocate: bool, per_engine: int) -> None:
    """Place the layout; every engine's GPUs, as its actor computes them for the server at start, are its planned
    ones, distinct from every other engine's, on one node and contiguous; colocated they are its training ranks'
    GPUs, disaggregated none of them is a training GPU."""
    placement = create_placement(num_actor, num_rollout, colocate, use_gpu=True, timeout_s=120)
    actors: list = []
    try:
        trainers = trainer_gpus(placement, num_actor)
        assert trainers == [placement.actor_gpu(r) for r in range(num_actor)]
        assert len({(t.node_id, t.gpu_id) for t in trainers}) == num_actor
        plans = placement.engine_gpus(per_engine)
        assert plans is not None and len(plans) == num_rollout // per_engine
        actors = engine_actors(placement, len(plans), per_engine, plans)
        launched = ray.get([a.placed_gpus.remote() for a in actors])
        taken: set[tuple[str, str]] = set()
        for e, (plan, gpus) in enumerate(zip(plans, launched, strict=True)):
            assert gpus == list(plan.gpu_ids), (e, plan, gpus)
            ids = [int(g) for g in gpus]
            assert ids == list(range(ids[0], ids[0] + per_engine)), (e, ids)  # contiguous, in TP order
            mine = {(plan.node_id, g) for g in gpus}
            assert len(mine) == per_engine and not mine & taken, (e, mine, taken)
            taken |= mine
            if colocate:
                ranks = trainers[e * per_engine : (e + 1) * per_engine]
                assert [(t.node_id, t.gpu_id) for t in ranks] == [(plan.node_id, g) for g in gpus], (e, ranks)
        if not colocate:
            assert not taken & {(t.node_id, t.gpu_id) for t in trainers}
    finally:
        for a in actors:
            ray.kill(a)
        ray.util.remove_placement_group(placement.pg)
