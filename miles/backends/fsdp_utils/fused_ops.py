"""Compiled (fused) versions of the elementwise parts of a HF decoder layer, for CUDA training forwards.

A profile of the FSDP2 bf16 train step of a Qwen3-1.7B shape on an H200 (16k-token packs, torch varlen attention)
spent 32% of the GPU time in matmuls and most of the rest in elementwise kernels: HF's RMSNorm upcasts to fp32
and runs six kernels (cast, pow, mean, rsqrt, mul, cast, mul), rotary embedding five per tensor, SwiGLU two, each
reading and writing the whole activation, and as many again in backward. `fuse_elementwise_ops` swaps, per module
instance, the forwards of RMSNorm and gated-SiLU MLP modules (and the modeling module's `apply_rotary_pos_emb`)
for the same formulas compiled by `torch.compile` (one Triton kernel forward, one backward, shapes dynamic so a
new pack length does not recompile). Same math in the same precision (fp32 inside the norm, the weight applied
after the cast back), not bitwise the same rounding as the eager kernels: it is applied on CUDA only, where the
trainer's log-probs are compared with the engine's at a tolerance anyway; CPU runs (and their golden numbers)
keep the eager modules. `--no-fused-elementwise` turns it off.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["fuse_elementwise_ops", "rms_norm_reference", "rotary_reference", "silu_mul_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back to x's dtype, then scale by `weight`."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise part: silu(gate) * up."""
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `apply_rotary_pos_emb` (rotate-half convention)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@cache
def _compiled(name: str) -> Callable[..., Any]:
    fn = {"rms_norm": rms_norm_reference, "silu_mul": silu_mul_reference, "rotary": rotary_reference}[name]
    return torch.compile(fn, dynamic=True)


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _compiled("rms_norm")(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_compiled("silu_mul")(self.gate_proj(x), self.up_proj(x)))


def _is_rms_norm(m: nn.Module) -> bool:
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and isinstance(getattr(m, "variance_epsilon", None), float)
        and not list(m.children())
    )


def _is_gated_silu_mlp(m: nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(
        isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")
    )


def _patch_rotary(module_name: str) -> bool:
    """Route the modeling module's `apply_rotary_pos_emb` through the compiled formula (once per module)."""
    mod = sys.modules.get(module_name)
    current = getattr(mod, "apply_rotary_pos_emb", None)
    if mod is None or current is None or getattr(current, "_miles_fused", False):
        return False
    original = current

    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kwargs or not q.is_cuda:
            return original(q, k, cos, sin, unsqueeze_dim, **kwargs)
        return _compiled("rotary")(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._miles_fused = True  # type: ignore[attr-defined]
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]
    return True


def compile_works(device: torch.device, dtype: torch.dtype) -> str | None:
    """Compile and run the three formulas forward and backward on small tensors of `device`/`dtype`; None when
    they agree with the eager references, else why not (no Triton, a compiler error, a wrong result)."""
    try:
        x = torch.randn(2, 5, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(16, device=device, dtype=dtype)
        q = torch.randn(2, 4, 5, 8, device=device, dtype=dtype, requires_grad=True)
        cos, sin = torch.randn(2, 2, 5, 8, device=device, dtype=dtype).unbind(0)
        pairs = [
            (_compiled("rms_norm")(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)),
            (_compiled("silu_mul")(x, x), silu_mul_reference(x, x)),
            (_compiled("rotary")(q, q, cos, sin)[0], rotary_reference(q, q, cos, sin)[0]),
        ]
        for got, want in pairs:
            got.float().sum().backward()
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                return f"compiled result differs from eager by {float((got - want).abs().max()):.3g}"
    except Exception as e:  # noqa: BLE001 - any failure means: stay eager, and say why
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


def fuse_elementwise_ops(model: nn.Module) -> dict[str, int]:
    """Swap the forwards of `model`'s RMSNorm and gated-SiLU MLP modules for compiled ones, and its attention
    modules' rotary embedding (modules whose class is defined next to an `apply_rotary_pos_emb`, as HF's Llama,
    Qwen2 and Qwen3 are). Returns how many of each were swapped; idempotent. Check `compile_works` first."""
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0}
    for m in model.modules():
        if getattr(m, "_miles_fused", False):
            continue
        if _is_rms_norm(m):
            m.forward = types.MethodType(_norm_forward, m)
            m._miles_fused = True
            counts["rms_norm"] += 1
        elif _is_gated_silu_mlp(m):
            m.forward = types.MethodType(_mlp_forward, m)
            m._miles_fused = True
            counts["mlp"] += 1
        elif type(m).__name__.endswith("Attention") and _patch_rotary(type(m).__module__):
            counts["rotary"] += 1
    logger.info("fused elementwise ops (torch.compile): %s", counts)
    return counts
