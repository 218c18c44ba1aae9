"""Tensor parallelism (--tensor-model-parallel-size, issue 28) equals one unsplit model: gloo, tiny random Qwen3
(4 heads / 2 KV heads, MLP 64), fp32. TP2 on 2 ranks and DP2 x TP2 on 4 ranks against a plain HF model that sees
every DP rank's pack: log-probs, loss, gradients, the clipped norm and one AdamW step's weights (<= 1e-5); the refit
gathers full tensors under the HF names; a DCP checkpoint saved at TP2 resumes at TP1 (FSDP2 over all ranks) and
back, the next step equal on both."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.integration._util import run_distributed, save_tiny_qwen3

VOCAB = 96
TEMPERATURE = 0.9
MAX_NORM = 0.05  # below the gradient norm: the clip scales every gradient


def _packs(dp_size: int):
    from miles.backends.fsdp_utils.data_packing import pack_sequences

    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(dp_size):
        samples = [
            {"tokens": torch.randint(0, VOCAB, (n,), generator=g).tolist(), "response_length": r}
            for n, r in ((9, 5), (4, 2), (13, 7))
        ]
        out.extend(pack_sequences(samples, num_packs=1))
    return out


def _loss(model, pack):
    from miles.backends.fsdp_utils.forward import forward_packed

    lps, _ = forward_packed(model, pack, TEMPERATURE)
    return sum((lp * (k + 1)).sum() for k, lp in enumerate(lps)), lps


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = 0.0) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _step_all_packs(model, opt, packs) -> torch.Tensor:
    """One step on the loss of every pack (each rank the same), averaged over the packs."""
    from miles.backends.fsdp_utils.model import clip_grad_norm_sharded

    opt.zero_grad()
    loss = sum(_loss(model, p)[0] for p in packs) / len(packs)
    loss.backward()
    norm = clip_grad_norm_sharded(model.parameters(), MAX_NORM)
    opt.step()
    return norm


def _body(rank: int, world_size: int, tp: int, tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.model import build_fsdp_model, build_optimizer, clip_grad_norm_sharded
    from miles.backends.fsdp_utils.parallel import init_distributed
    from miles.refit.buckets import iter_weight_buckets

    path = os.path.join(tmp, "model")
    ps = init_distributed("gloo", cp_size=1, tp_size=tp)
    assert ps.dp_size * tp == world_size and ps.tp_mesh is not None
    model = build_fsdp_model(path, ps.fsdp_mesh, tp_mesh=ps.tp_mesh)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    packs = _packs(ps.dp_size)

    # forward / backward: this rank's pack; FSDP2 averages the gradients over the DP ranks
    loss, lps = _loss(model, packs[ps.dp_rank])
    loss.backward()
    ref_losses = [_loss(ref, p) for p in packs]
    (sum(lo for lo, _ in ref_losses) / ps.dp_size).backward()
    _close(loss, ref_losses[ps.dp_rank][0], "loss")
    for a, b in zip(lps, ref_losses[ps.dp_rank][1], strict=True):
        _close(a, b, "log-probs")
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in model.named_parameters():
        _close(_full(p.grad), ref_grads[n], f"grad of {n}")
    assert (
        sum(p.device_mesh.ndim == 2 for p in model.parameters()) == 2 * 9
    )  # the split projections and norms

    # one clipped AdamW step
    opt, ref_opt = build_optimizer(model.parameters(), lr=1e-2), build_optimizer(ref.parameters(), lr=1e-2)
    norm = clip_grad_norm_sharded(model.parameters(), MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert ref_norm > MAX_NORM
    _close(norm, ref_norm, "grad norm", rtol=1e-6)  # ~90: fp32 rounding
    opt.step()
    ref_opt.step()
    ref_params = dict(ref.named_parameters())
    for n, t in _full_params(model).items():
        _close(t, ref_params[n].detach(), f"updated {n}")

    # the refit: full tensors under the HF names
    sent = {name: t for bucket in iter_weight_buckets(model, 1 << 14) for name, t in bucket}
    ref_sd = ref.state_dict()
    assert set(sent) <= set(ref_sd) and "model.layers.0.self_attn.q_proj.weight" in sent
    for name, t in sent.items():
        assert t.shape == ref_sd[name].shape, name
        _close(t, ref_sd[name], f"refit {name}")

    _resume_across_tp(model, opt, ps, path, tmp, packs)


def _resume_across_tp(model, opt, ps, path: str, tmp: str, packs) -> None:
    """TP checkpoint -> TP1 (FSDP2 over all ranks) -> TP again: each resumed pair takes the same next step."""
    from torch.distributed.device_mesh import init_device_mesh

    from miles.backends.fsdp_utils.checkpoint import load_checkpoint, save_checkpoint
    from miles.backends.fsdp_utils.model import build_fsdp_model, build_optimizer

    tp_dir, flat_dir = os.path.join(tmp, "ckpt_tp"), os.path.join(tmp, "ckpt_tp1")
    save_checkpoint(tp_dir, 0, model, opt, None)
    flat_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("all",))
    flat = build_fsdp_model(path, flat_mesh)
    flat_opt = build_optimizer(flat.parameters(), lr=1e-2)
    assert load_checkpoint(tp_dir, flat, flat_opt, None) is not None
    for (n, a), b in zip(_full_params(model).items(), _full_params(flat).values(), strict=True):
        assert torch.equal(a, b), f"TP -> TP1 resume: {n}"
    _close(
        _step_all_packs(model, opt, packs), _step_all_packs(flat, flat_opt, packs), "resumed norm", rtol=1e-6
    )
    for (n, a), b in zip(_full_params(model).items(), _full_params(flat).values(), strict=True):
        _close(a, b, f"step after TP -> TP1 resume: {n}")

    save_checkpoint(flat_dir, 1, flat, flat_opt, None)
    again = build_fsdp_model(path, ps.fsdp_mesh, tp_mesh=ps.tp_mesh)
    again_opt = build_optimizer(again.parameters(), lr=1e-2)
    assert load_checkpoint(flat_dir, again, again_opt, None) is not None
    for (n, a), b in zip(_full_params(flat).items(), _full_params(again).values(), strict=True):
        assert torch.equal(a, b), f"TP1 -> TP resume: {n}"
    _close(
        _step_all_packs(flat, flat_opt, packs),
        _step_all_packs(again, again_opt, packs),
        "resumed norm",
        rtol=1e-6,
    )
    for (n, a), b in zip(_full_params(flat).items(), _full_params(again).values(), strict=True):
        _close(a, b, f"step after TP1 -> TP resume: {n}")


def test_tp2_equals_unsplit_model(tmp_path):
    save_tiny_qwen3(str(tmp_path / "model"), seed=0, vocab_size=VOCAB)
    run_distributed(_body, 2, 2, str(tmp_path))


@pytest.mark.slow
def test_dp2_tp2_equals_unsplit_model(tmp_path):
    save_tiny_qwen3(str(tmp_path / "model"), seed=0, vocab_size=VOCAB)
    run_distributed(_body, 4, 2, str(tmp_path))
