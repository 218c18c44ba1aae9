"""The critic's loss: clipped value regression onto the GAE returns, and explained variance.

Pure: per-sample lists ``B x [L_i]`` in, ``(loss, metrics)`` out; the reduction (and so the DP scaling) is the
named one of `miles.algo.reductions`, exactly as for the policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.metrics import masked_metric
from miles.algo.reductions import LossReduction, reduce_loss_and_metric


@dataclass
class ValueLossInputs:
    values: list[Tensor]  # B x [L_i]: the critic's current predictions (differentiable)
    old_values: list[Tensor]  # B x [L_i]: predictions before this rollout's first update (the GAE values)
    returns: list[Tensor]  # B x [L_i]: regression targets (GAE advantages + old values)
    loss_masks: list[Tensor]  # B x [L_i]

    def __post_init__(self) -> None:
        for name in ("values", "old_values", "returns"):
            _ops.check_aligned(name, getattr(self, name), self.loss_masks)


def compute_value_loss(
    inputs: ValueLossInputs,
    value_clip: float | None,
    reduction: LossReduction,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per token ``0.5 * max((v - R)^2, (v_clip - R)^2)`` with ``v_clip = old + clamp(v - old, -c, c)``
    (c = `value_clip`; None: the plain ``0.5 * (v - R)^2``), reduced with `reduction`: divided by its
    `denominator` (see `reduction_denominator`: global samples / dp for sample_mean, global loss tokens / dp for
    token_mean). Metrics (numerator, count pairs): ``value_loss`` under that reduction, ``value_clipfrac``
    (token mean of "the value moved past the clip range and the clipped term was the larger one") and the sums ``explained_variance`` needs
    (``ev_*``, see `explained_variance`)."""
    flat_mask = _ops.cat(inputs.loss_masks).float()
    v = _ops.cat([x.float() for x in inputs.values])
    old = _ops.cat([x.float() for x in inputs.old_values]).detach()
    ret = _ops.cat([x.float() for x in inputs.returns]).detach()
    unclipped = (v - ret).square()
    if value_clip is None:
        per_token = 0.5 * unclipped
        clipped_more = torch.zeros_like(unclipped)
    else:
        if value_clip <= 0:
            raise ValueError(f"value_clip={value_clip} must be > 0 (or None for no clipping)")
        v_clip = old + (v - old).clamp(-value_clip, value_clip)
        clipped = (v_clip - ret).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_more = (((v - old).abs() > value_clip) & (clipped > unclipped)).float()
    lengths = _ops.lengths_of(inputs.loss_masks)
    losses = _ops.split(per_token, lengths)
    loss, loss_metric = reduce_loss_and_metric(
        reduction.kind, losses, inputs.loss_masks, reduction.denominator, reduction.constant
    )
    err = (ret - v.detach()).double()
    ret64 = ret.double()
    mask64 = flat_mask.double()

    def total(x: Tensor) -> Tensor:
        return torch.stack([_ops.masked(x, mask64).sum(), torch.ones((), dtype=torch.float64)])

    metrics = {
        "value_loss": loss_metric,
        "value_clipfrac": masked_metric(clipped_more, flat_mask),
        "ev_n": torch.stack([mask64.sum(), torch.ones((), dtype=torch.float64)]),
        "ev_ret": total(ret64),
        "ev_ret_sq": total(ret64.square()),
        "ev_err": total(err),
        "ev_err_sq": total(err.square()),
    }
    return loss, metrics


def explained_variance(n: float, ret: float, ret_sq: float, err: float, err_sq: float) -> float:
    """1 - Var(R - V) / Var(R) from global sums over loss tokens (n tokens; sums of R, R^2, R - V, (R - V)^2).
    nan when the returns have no variance (or there are no tokens)."""
    if n <= 0:
        return float("nan")
    var_ret = ret_sq / n - (ret / n) ** 2
    var_err = err_sq / n - (err / n) ** 2
    if var_ret <= 0:
        return float("nan")
    return 1.0 - var_err / var_ret
