"""MoE under context parallelism (issue 28) equals the unsplit model: gloo, tiny random Qwen3-MoE (4 experts, top-2,
2 layers), fp32, through the actor's `MoETraining` hooks and the FSDP2 model of `build_fsdp_model`.

- CP2 (2 ranks) against a plain HF model on the whole pack: rollout routing replay (R3, replayed experts other than
  the router's top-k, split over the CP ranks as the tokens are) with the load-balancing and z losses (their
  statistics summed over the CP group): log-probs, the experts used, loss, router losses, gradients and one AdamW
  step (<= 1e-5); `--use-routing-replay` records the same experts per sample as the unsplit model.
- EP2 x CP2 (4 ranks, DP2): the same against the reference that sees both replicas' packs (loss averaged over DP).
The pack has 25 tokens: one CP padding token, and a sequence straddling the chunk boundary."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.integration._util import run_distributed
from tests.integration.test_expert_parallel import _save

VOCAB, TEMPERATURE, LR = 48, 0.9, 1e-3
LAYERS, EXPERTS, TOP_K = 2, 4, 2
AUX, Z = 0.1, 0.01
SHAPES = ((9, 5), (4, 2), (12, 7))  # (tokens, response length): 25 tokens, odd


def _batch(replica: int) -> tuple[list[list[int]], list[int], list[np.ndarray]]:
    """One DP replica's samples: token ids, response lengths and engine-routed experts ([n-1, L*K] uint8, the
    sample layout), random distinct experts per token (mostly not the router's top-k)."""
    rng = np.random.default_rng(5 + replica)
    tokens = [rng.integers(0, VOCAB, n).tolist() for n, _ in SHAPES]
    routed = [
        np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range((n - 1) * LAYERS)])
        .reshape(n - 1, LAYERS * TOP_K)
        .astype(np.uint8)
        for n, _ in SHAPES
    ]
    return tokens, [r for _, r in SHAPES], routed


def _pack(tokens, responses):
    from miles.backends.fsdp_utils.data_packing import pack_sequences

    samples = [{"tokens": t, "response_length": r} for t, r in zip(tokens, responses)]
    (pack,) = pack_sequences(samples, num_packs=1)
    assert pack.sample_indices.tolist() == list(range(len(tokens)))  # pack order = sample order
    return pack


def _forward(moe, model, replica: int, cp, routed: bool = True):
    """(token loss + router losses, log-probs, router metrics, the experts used over the whole pack)."""
    from miles.backends.fsdp_utils.context_parallel import cp_gather_rows
    from miles.backends.fsdp_utils.forward import forward_packed

    tokens, responses, experts = _batch(replica)
    pack = _pack(tokens, responses)
    moe.start_batch(experts if routed else [None] * len(tokens))
    with moe.forward(tokens, pack.sample_indices.tolist()) as capture:
        lps, _ = forward_packed(model, pack, TEMPERATURE, cp=cp)
    router_loss, metrics = moe.loss(capture, 1)
    loss = sum((lp * (k + 1)).sum() for k, lp in enumerate(lps))
    if router_loss is not None:
        loss = loss + router_loss
    used = capture.stacked_experts()
    if cp is not None:
        used = cp_gather_rows(used, cp, pack.num_tokens)
    return loss, lps, metrics, used


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(a, b, what: str, rtol: float = 0.0) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _routing_replay_records(model, ref, replica: int, cp) -> None:
    """--use-routing-replay: the first forward records each sample's experts (gathered over CP), the second
    replays them; both equal the unsplit model's."""
    from miles.backends.fsdp_utils.moe import MoETraining

    moe, ref_moe = MoETraining(model, routing_replay=True, cp=cp), MoETraining(ref, routing_replay=True)
    with torch.no_grad():
        for _ in range(2):
            _, lps, _, used = _forward(moe, model, replica, cp, routed=False)
            _, ref_lps, _, ref_used = _forward(ref_moe, ref, replica, None, routed=False)
            assert torch.equal(used, ref_used), "experts used"
            for a, b in zip(lps, ref_lps, strict=True):
                _close(a, b, "routing-replay log-probs")
    assert moe.recorded.keys() == ref_moe.recorded.keys() == {0, 1, 2}
    for i, experts in moe.recorded.items():
        assert experts.shape == (SHAPES[i][0], LAYERS, TOP_K) and torch.equal(experts, ref_moe.recorded[i]), i


def _body(rank: int, world: int, cp_size: int, ep: int, tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.context_parallel import CPContext
    from miles.backends.fsdp_utils.model import build_fsdp_model, build_optimizer
    from miles.backends.fsdp_utils.moe import MoETraining
    from miles.backends.fsdp_utils.parallel import init_distributed

    path = os.path.join(tmp, "model")
    ps = init_distributed("gloo", cp_size=cp_size)
    cp = CPContext(ps.cp_group, ps.cp_rank, ps.cp_size)
    model = build_fsdp_model(path, ps.fsdp_mesh, ep_size=ep)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    _routing_replay_records(model, ref, ps.dp_rank, cp)

    moe = MoETraining(model, AUX, Z, rollout_replay=True, cp=cp)
    ref_moe = MoETraining(ref, AUX, Z, rollout_replay=True)
    loss, lps, metrics, used = _forward(moe, model, ps.dp_rank, cp)
    loss.backward()
    refs = [_forward(ref_moe, ref, d, None) for d in range(ps.dp_size)]
    (sum(r[0] for r in refs) / ps.dp_size).backward()
    ref_loss, ref_lps, ref_metrics, ref_used = refs[ps.dp_rank]
    _close(loss, ref_loss, "loss", rtol=1e-6)
    assert metrics.keys() == ref_metrics.keys() and metrics["moe/aux_loss"] > 0.5, metrics
    for k in metrics:
        _close(torch.tensor(metrics[k]), torch.tensor(ref_metrics[k]), k, rtol=1e-6)
    assert torch.equal(used, ref_used), "experts used"
    routed = torch.cat([torch.as_tensor(r).long() for r in _batch(ps.dp_rank)[2]]).view(-1, LAYERS, TOP_K)
    ends = np.cumsum([n for n, _ in SHAPES]) - 1  # each sequence's last token: the router's own choice
    assert torch.equal(used[np.setdiff1d(np.arange(used.shape[0]), ends)], routed), "the replayed experts"
    for a, b in zip(lps, ref_lps, strict=True):
        _close(a, b, "log-probs")
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        _close(_full(p.grad), ref_params[n].grad, f"grad of {n}")
    assert float(ref_params["model.layers.0.mlp.gate.weight"].grad.abs().max()) > 1e-3  # the router learns
    opt, ref_opt = build_optimizer(model.parameters(), lr=LR), build_optimizer(ref.parameters(), lr=LR)
    opt.step()
    ref_opt.step()
    for n, p in model.named_parameters():
        _close(_full(p.detach()), ref_params[n].detach(), f"updated {n}")


def test_cp2_moe_replay_and_router_losses_equal_cp1(tmp_path):
    _save(tmp_path)
    run_distributed(_body, 2, 2, 1, str(tmp_path))


@pytest.mark.slow
def test_ep2_cp2_moe_equals_unsplit(tmp_path):
    _save(tmp_path)
    run_distributed(_body, 4, 2, 2, str(tmp_path), timeout_s=600)  # 4 ranks on 2 cores: ~4 min
