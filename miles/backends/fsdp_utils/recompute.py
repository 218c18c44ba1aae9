"""Recompute the gated-SiLU MLP's elementwise activations in the backward instead of keeping them (CPU training).

A decoder layer's MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, keeps four [T, intermediate] tensors for
its backward: ``gate`` (for silu's), ``silu(gate)`` and ``up`` (for the product's), and the product (for
down_proj's weight gradient). Measured on `scripts/bench/vs_trl.py`'s compute workload (25M Qwen3, 2.4k-token
micro-batches, fp32): the whole model keeps ~960 MiB per micro-batch, half of it these four.

`recompute_mlp_activations` wraps each such module's forward in a selective activation checkpoint
(`torch.utils.checkpoint` with a `create_selective_checkpoint_contexts` policy): the outputs of the gate and up
matmuls are kept, ``silu(gate)`` and the product are not, and the backward recomputes them from the kept matmul
outputs (one silu and one multiply; early stop ends the recomputation before down_proj's matmul). That keeps
two [T, intermediate] tensors instead of four: ~190 MiB less per micro-batch on that workload, ~20% of its
activations. The autograd graph is the one the eager forward records (non-reentrant checkpointing only swaps
where the saved tensors come from), and the recomputed values are the same kernels on the same inputs, so
losses and gradients are bit for bit those of the eager module.

Applied on CPU only (host memory is shared by the ranks and the colocated engines, and the golden CPU runs are
where bitwise equality is checked), and not with --gradient-checkpointing (which already recomputes the whole
layer). A forward without gradients (log-probs, generation) runs the eager module unchanged.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["recompute_mlp_activations"]

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _is_gated_silu_mlp(m: nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(
        isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")
    )


def _storage_ptr(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def _policy(
    down_weight: torch.Tensor | None, ctx: Any, func: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    """Keep the matmul outputs but down_proj's (nothing in the backward reads it), recompute the rest."""
    if func in _MATMULS:
        reads_down = down_weight is not None and any(
            _storage_ptr(a) == down_weight.untyped_storage().data_ptr() for a in args
        )
        if not reads_down:
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(module: nn.Module) -> Any:
    weight = getattr(module.down_proj, "weight", None)
    down_weight = weight if isinstance(weight, torch.Tensor) else None
    return create_selective_checkpoint_contexts(functools.partial(_policy, down_weight))


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eager = self._miles_eager_forward
    if not (self.training and torch.is_grad_enabled()):
        return eager(x)
    return checkpoint(eager, x, use_reentrant=False, context_fn=functools.partial(_contexts, self))


def recompute_mlp_activations(model: nn.Module) -> int:
    """Wrap the forward of every gated-SiLU MLP module of `model` (see the module docstring); returns how many.
    Idempotent."""
    count = 0
    for m in model.modules():
        if getattr(m, "_miles_eager_forward", None) is not None or not _is_gated_silu_mlp(m):
            continue
        m._miles_eager_forward = m.forward
        m.forward = types.MethodType(_forward, m)
        count += 1
    return count
