"""Expert parallelism when a rank's experts receive no token in a layer (issue 28): EP2 on 2 gloo ranks, both
ranks route every token to experts 0 and 1 (routing replay), so rank 1's experts 2 and 3 get nothing. Its
backward must still join the all-to-alls the other rank's backward runs (before the fix its expert output did
not depend on the received rows, autograd skipped them and gloo's collectives went out of step, aborting the
e2e run at rollout 10); the step then equals the unsplit model's (whose idle experts get zero gradients)."""

from __future__ import annotations

import os

import torch

from tests.integration._util import run_distributed
from tests.integration.test_expert_parallel import EXPERTS, LAYERS, TOP_K, _packs, _save, _step_and_compare


def _body(rank: int, world: int, tmp: str) -> None:
    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed

    ps = init_distributed("gloo")
    path = os.path.join(tmp, "model")
    model = build_fsdp_model(path, ps.fsdp_mesh, ep_size=2)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    packs = _packs(world)
    only_first = [torch.arange(TOP_K).expand(26, LAYERS, TOP_K).clone() for _ in packs]  # 26 tokens a pack
    assert EXPERTS // 2 == TOP_K  # rank 0 holds experts 0..TOP_K-1: all of them
    _step_and_compare(model, ref, packs, rank, world, replays=only_first, aux_coeff=0.1)


def test_ep2_rank_without_tokens(tmp_path):
    _save(tmp_path)
    run_distributed(_body, 2, str(tmp_path))
