"""Expert parallelism (--expert-model-parallel-size, issue 28) equals one unsplit model: gloo, tiny random
Qwen3-MoE (4 experts, top-2, 2 layers), fp32. EP2 on 2 ranks and DP4 with EP2 on 4 ranks (experts split over
pairs of ranks, FSDP2 over the ranks holding the same experts) against a plain HF model that sees every rank's
pack: log-probs, loss, gradients, the clipped norm and one AdamW step's weights (<= 1e-5); then the same with
routing replay (R3: other experts than the router's top-k, replayed before dispatch) and the auxiliary loss; the
refit gathers every expert into the HF names and values of the unsplit model; a DCP checkpoint saved with EP
loads into a model without EP."""

from __future__ import annotations

import os

import pytest
import torch

from tests.integration._util import run_distributed

VOCAB = 48
TEMPERATURE = 0.9
MAX_NORM = 0.05  # below the gradient norm: the clip scales every gradient
# AdamW's first step moves a weight by about lr whatever its gradient's size, so a gradient of ~1e-8 whose last bits
# differ (other summation orders) moves differently: at lr 1e-2 one element of 4096 was 1.2e-5 off; the gradients
# themselves are compared at 1e-5
LR = 1e-3
LAYERS, EXPERTS, TOP_K = 2, 4, 2


def _packs(world: int):
    from miles.backends.fsdp_utils.data_packing import pack_sequences

    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(world):
        samples = [
            {"tokens": torch.randint(0, VOCAB, (n,), generator=g).tolist(), "response_length": r}
            for n, r in ((9, 5), (4, 2), (13, 7))
        ]
        out.extend(pack_sequences(samples, num_packs=1))
    return out


def _replays(world: int) -> list[torch.Tensor]:
    """Per pack, [26, layers, top_k] random distinct experts per token (mostly not the router's top-k)."""
    g = torch.Generator().manual_seed(11)
    return [
        torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(26 * LAYERS)]).view(
            26, LAYERS, TOP_K
        )
        for _ in range(world)
    ]


def _loss(model, pack, replay=None, aux_coeff=0.0):
    from miles.backends.fsdp_utils.forward import forward_packed
    from miles.backends.fsdp_utils.moe import moe_routing, router_losses

    with moe_routing(model, replay) as capture:
        lps, _ = forward_packed(model, pack, TEMPERATURE)
    loss = sum((lp * (k + 1)).sum() for k, lp in enumerate(lps))
    if aux_coeff:
        loss = loss + aux_coeff * router_losses(capture, EXPERTS, TOP_K)[0]
    return loss, lps, capture.stacked_experts()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = 0.0) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _step_and_compare(model, ref, packs, rank: int, world: int, replays=None, aux_coeff=0.0) -> None:
    """Forward/backward of this rank's pack vs the reference on every pack (its loss averaged over the ranks),
    then one clipped AdamW step of both: everything equal."""
    from miles.backends.fsdp_utils.model import build_optimizer, clip_grad_norm_sharded

    pick = (lambda i: replays[i]) if replays is not None else (lambda i: None)
    loss, lps, experts = _loss(model, packs[rank], pick(rank), aux_coeff)
    loss.backward()
    refs = [_loss(ref, p, pick(i), aux_coeff) for i, p in enumerate(packs)]
    (sum(r[0] for r in refs) / world).backward()
    _close(loss, refs[rank][0], "loss", rtol=1e-6)  # ~144: one fp32 ulp is 1.5e-5
    assert torch.equal(experts, refs[rank][2]), "routed experts"
    if replays is not None:
        assert torch.equal(experts, replays[rank]), "the replayed experts are the ones used"
    for a, b in zip(lps, refs[rank][1], strict=True):
        _close(a, b, "log-probs")
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        _close(_full(p.grad), ref_params[n].grad, f"grad of {n}")
    opt, ref_opt = build_optimizer(model.parameters(), lr=LR), build_optimizer(ref.parameters(), lr=LR)
    norm = clip_grad_norm_sharded(model.parameters(), MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert ref_norm > MAX_NORM
    _close(norm, ref_norm, "grad norm", rtol=1e-6)
    opt.step()
    ref_opt.step()
    for n, p in model.named_parameters():
        _close(_full(p.detach()), ref_params[n].detach(), f"updated {n}")
    opt.zero_grad()
    ref_opt.zero_grad()


def _body(rank: int, world: int, ep: int, tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.expert_parallel import ExpertParallelExperts
    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed
    from miles.refit.buckets import iter_weight_buckets

    path = os.path.join(tmp, "model")
    ps = init_distributed("gloo")
    model = build_fsdp_model(path, ps.fsdp_mesh, ep_size=ep)
    units = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert len(units) == LAYERS and units[0].local_experts == EXPERTS // ep
    assert units[0].gate_up_proj.shape[0] == EXPERTS  # the full HF shape; each rank stores world-th of it
    assert units[0].gate_up_proj.to_local().shape[0] == EXPERTS // world
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    packs = _packs(world)
    _step_and_compare(model, ref, packs, rank, world)
    _step_and_compare(model, ref, packs, rank, world, replays=_replays(world), aux_coeff=0.1)

    sent = {name: t for bucket in iter_weight_buckets(model, 1 << 14) for name, t in bucket}
    ref_sd = ref.state_dict()
    assert set(sent) <= set(ref_sd) and "model.layers.1.mlp.experts.gate_up_proj" in sent, sorted(sent)
    for name, t in sent.items():
        assert t.shape == ref_sd[name].shape, name
        _close(t, ref_sd[name], f"refit {name}")

    # a DCP checkpoint saved with EP loads into a model without EP (FSDP2 over all ranks), every weight equal
    from miles.backends.fsdp_utils.checkpoint import load_checkpoint, save_checkpoint
    from miles.backends.fsdp_utils.model import build_optimizer

    save_checkpoint(os.path.join(tmp, "ckpt"), 0, model, build_optimizer(model.parameters(), lr=LR), None)
    flat = build_fsdp_model(path, ps.fsdp_mesh)
    assert load_checkpoint(os.path.join(tmp, "ckpt"), flat, build_optimizer(flat.parameters(), lr=LR), None)
    flat_params = dict(flat.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(_full(p.detach()), _full(flat_params[n].detach())), f"EP -> EP1 resume: {n}"


def _save(tmp_path) -> None:
    from miles.tools.tiny_moe import build_tiny_moe

    build_tiny_moe(
        str(tmp_path / "model"),
        hidden_size=32,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        top_k=TOP_K,
        vocab_size=VOCAB,
        initializer_range=0.2,
    )


def test_ep2_equals_unsplit_moe(tmp_path):
    _save(tmp_path)
    run_distributed(_body, 2, 2, str(tmp_path))


@pytest.mark.slow
def test_dp4_ep2_equals_unsplit_moe(tmp_path):
    _save(tmp_path)
    run_distributed(_body, 4, 2, str(tmp_path))
