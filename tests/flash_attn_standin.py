"""A plain-torch stand-in for the two FlashAttention-2 kernels ring-flash-attn's varlen variants call, so that its
orchestration (all-gathers, K-slices, reduce-scatters, LSE handling) runs on CPU in tests.

    install()   # before importing ring-flash-attn: sys.modules gets `flash_attn` and `flash_attn.flash_attn_interface`

The functions keep flash-attn 2.7+'s names, parameters (ring-flash-attn reads their signatures) and results:
`_flash_attn_varlen_forward(...) -> (out [Tq, H, D], softmax_lse [H, Tq] fp32, S_dmask, rng_state)` and
`_flash_attn_varlen_backward(...)` writing dq, dk, dv in place. Causal masks are aligned bottom-right per sequence
(query i of a sequence with lq queries and lk keys sees keys 0 .. lk - lq + i), as flash-attn >= 2.1 does; GQA maps
query head h to KV head h // (H / Hkv). Strict: anything the stand-in does not implement (dropout, windows,
softcap, ALiBi, a block table) raises instead of being ignored. `CALLS` counts forward and backward calls.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections import Counter

import torch

CALLS: Counter[str] = Counter()


def _check_unsupported(
    dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, **extra
) -> None:
    if dropout_p:
        raise NotImplementedError(f"stand-in: dropout_p={dropout_p}")
    if (window_size_left, window_size_right) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"stand-in: window ({window_size_left}, {window_size_right})")
    if softcap:
        raise NotImplementedError(f"stand-in: softcap={softcap}")
    if alibi_slopes is not None:
        raise NotImplementedError("stand-in: alibi_slopes")
    for name, value in extra.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"stand-in: {name}={value!r}")


def _attention(q, k, v, cu_q, cu_k, scale, causal):
    """q [Tq, H, D], k/v [Tk, Hkv, D] -> (out [Tq, H, D], lse [H, Tq] fp32), differentiable."""
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    outs, lses = [], []
    for qa, qb, ka, kb in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        lq, lk = qb - qa, kb - ka
        qs = q[qa:qb].transpose(0, 1).float()  # [H, lq, D]
        ks = k[ka:kb].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        vs = v[ka:kb].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        scores = (qs @ ks.transpose(1, 2)) * scale  # [H, lq, lk]
        if causal:
            allowed = torch.arange(lk)[None, :] <= (lk - lq) + torch.arange(lq)[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, lq]; -inf for a query that sees no key
        probs = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
        outs.append((probs @ vs).transpose(0, 1).to(q.dtype))  # [lq, H, D]
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros((heads, 0), dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
    zero_tensors=False,
):
    _check_unsupported(
        dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, block_table=block_table,
        leftpad_k=leftpad_k, seqused_k=seqused_k, return_softmax=return_softmax,
    )  # fmt: skip
    assert q.shape[0] == int(cu_seqlens_q[-1]) and k.shape[0] == int(cu_seqlens_k[-1]), "tokens vs cu_seqlens"
    assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
    assert int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) <= max_seqlen_k
    CALLS["forward"] += 1
    with torch.no_grad():
        out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out, lse, None, None


def _flash_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
    zero_tensors=False,
):
    _check_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    assert softmax_lse.shape == (q.shape[1], q.shape[0]), "softmax_lse is [H, total_q]"
    CALLS["backward"] += 1
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        again, lse = _attention(*leaves, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        torch.testing.assert_close(lse, softmax_lse, atol=1e-5, rtol=1e-5, msg="the forward's LSE came back")
        grads = torch.autograd.grad(again, leaves, dout)
    for buf, grad in zip((dq, dk, dv), grads):
        buf.copy_(grad)
    return None


def install() -> None:
    """Put `flash_attn` and `flash_attn.flash_attn_interface` (these two kernels) into sys.modules."""
    package = types.ModuleType("flash_attn")
    package.__path__ = []  # a package, so `flash_attn.flash_attn_interface` resolves
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    # specs, as imported modules have: importlib.util.find_spec raises ValueError for a module in sys.modules
    # without one (transformers' flash-attn availability check, run when transformers is imported after this)
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    interface.__spec__ = importlib.machinery.ModuleSpec("flash_attn.flash_attn_interface", None)
    interface._flash_attn_varlen_forward = _flash_attn_varlen_forward
    interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    package.flash_attn_interface = interface
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = interface
