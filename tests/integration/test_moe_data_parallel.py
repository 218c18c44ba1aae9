"""A tiny Qwen3-MoE without expert parallelism (EP1) on 2 data-parallel gloo ranks equals the single-rank reference
(issue 28): FSDP2 shards every weight, experts included, over both ranks, each rank trains its own pack, and a plain
HF model that sees both packs (its loss averaged over the ranks) gets the same log-probs, loss, gradients, clipped
norm and one AdamW step's weights within 1e-5, first with the router's own top-k, then with routing replay (other
experts than the router's top-k) and the load-balancing loss. The harness is test_expert_parallel's."""

from __future__ import annotations

import os

from tests.integration._util import run_distributed
from tests.integration.test_expert_parallel import LAYERS, _packs, _replays, _save, _step_and_compare


def _body(rank: int, world: int, tmp: str) -> None:
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.expert_parallel import ExpertParallelExperts
    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed

    path = os.path.join(tmp, "model")
    ps = init_distributed("gloo")
    model = build_fsdp_model(path, ps.fsdp_mesh)
    assert not [m for m in model.modules() if isinstance(m, ExpertParallelExperts)], "EP1: no expert split"
    experts = model.model.layers[LAYERS - 1].mlp.experts.gate_up_proj
    assert isinstance(experts, DTensor), "FSDP2 shards the experts"
    assert experts.to_local().shape[0] == experts.shape[0] // world, experts.to_local().shape
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    packs = _packs(world)
    _step_and_compare(model, ref, packs, rank, world)
    _step_and_compare(model, ref, packs, rank, world, replays=_replays(world), aux_coeff=0.1)


def test_dp2_ep1_moe_equals_single_rank(tmp_path):
    _save(tmp_path)
    run_distributed(_body, 2, str(tmp_path))
