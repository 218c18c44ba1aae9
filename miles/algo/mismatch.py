"""Training-inference mismatch corrections: TIS weights, MIS masks, and mismatch metrics.

`rollout_log_probs` are the log-probs the rollout engine reported when it sampled the tokens; `old_log_probs`
are the trainer's log-probs of the same tokens under the same weights, before any update in this step. They
differ through numerics (kernels, precision, batching). The policy loss is built on `old_log_probs`; the
tokens however came from the rollout policy, so each token's loss is re-weighted by

    w_t = clip(exp(old_log_probs - rollout_log_probs), tis_clip_low, tis_clip)      (TIS, detached)

and/or tokens whose ratio is implausible are dropped (MIS). Weights multiply the per-token policy loss; they do
not change the reduction's denominators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.metrics import masked_metric

if TYPE_CHECKING:
    from miles.algo.loss import LossSettings

MIS_LEVELS = ("token", "sequence")

# ``--custom-tis-function-path``: fn(old_log_probs, rollout_log_probs, loss_masks, settings) -> (weights, metrics)
# with the first three ``B x [L_i]`` lists, `settings` the LossSettings of the micro-batch, `weights` one
# per-token tensor per sample (detached by the caller) and `metrics` (numerator, count) pairs (miles.algo.metrics)
CustomTISFn = Callable[
    [list[Tensor], list[Tensor], list[Tensor], "LossSettings"], tuple[list[Tensor], dict[str, Tensor]]
]


def _check_bounds(lower_name: str, lower: float, upper_name: str, upper: float) -> None:
    if not 0 <= lower <= upper:
        raise ValueError(f"need 0 <= {lower_name} ({lower}) <= {upper_name} ({upper})")


@dataclass(frozen=True)
class TIS:
    """Truncated importance sampling: weight each token by clip(exp(old - rollout), lo, hi)."""

    lo: float = 0.0  # --tis-clip-low
    hi: float = 2.0  # --tis-clip

    def __post_init__(self) -> None:
        _check_bounds("tis_clip_low", self.lo, "tis_clip", self.hi)


@dataclass(frozen=True)
class MIS:
    """Masked importance sampling: drop tokens (or whole samples) whose ratio lies outside [lo, hi]."""

    level: str = "token"  # --mis-level: token | sequence
    lo: float = 0.5  # --mis-lower
    hi: float = 2.0  # --mis-upper

    def __post_init__(self) -> None:
        if self.level not in MIS_LEVELS:
            raise ValueError(f"mis_level={self.level!r}; choose one of {list(MIS_LEVELS)}")
        _check_bounds("mis_lower", self.lo, "mis_upper", self.hi)


@dataclass(frozen=True)
class TISAndMIS:
    """Both corrections: the TIS weight times the MIS keep mask."""

    tis: TIS
    mis: MIS


@dataclass(frozen=True)
class CustomMismatch:
    """A user function (``--custom-tis-function-path``, resolved by the trainer) that replaces TIS and MIS."""

    fn: CustomTISFn


# the mismatch correction of the policy loss; None (no correction) where a Mismatch | None is taken
Mismatch = TIS | MIS | TISAndMIS | CustomMismatch


def compute_tis_weights(
    old_log_probs: list[Tensor], rollout_log_probs: list[Tensor], tis: TIS
) -> list[Tensor]:
    """Per-token truncated importance weights clip(exp(old - rollout), tis.lo, tis.hi), detached."""
    _ops.check_aligned("old_log_probs", old_log_probs, rollout_log_probs, "rollout_log_probs")
    return [
        torch.exp(o.detach().float() - r.detach().float()).clamp(tis.lo, tis.hi)
        for o, r in zip(old_log_probs, rollout_log_probs)
    ]


def compute_mis_mask(
    old_log_probs: list[Tensor], rollout_log_probs: list[Tensor], loss_masks: list[Tensor], mis: MIS
) -> list[Tensor]:
    """Per-token 0/1 masked importance sampling (MIS) weights; 0 = dropped.

    level "token": drop token t iff exp(old_t - rollout_t) is outside [mis.lo, mis.hi].
    level "sequence": drop every token of sample i iff its geometric-mean ratio
    exp(mean_t (old_t - rollout_t)) (mean over the sample's loss tokens) is outside [mis.lo, mis.hi].
    Values at mask-0 positions are not read (those positions get weight 1 at level "token").
    """
    _ops.check_aligned("old_log_probs", old_log_probs, loss_masks)
    _ops.check_aligned("rollout_log_probs", rollout_log_probs, loss_masks)
    lengths = _ops.lengths_of(loss_masks)
    if not lengths:
        return []
    old_log_probs = _ops.masked_list(old_log_probs, loss_masks)
    rollout_log_probs = _ops.masked_list(rollout_log_probs, loss_masks)
    log_ratio = (_ops.cat(old_log_probs).float() - _ops.cat(rollout_log_probs).float()).detach()
    if mis.level == "sequence":
        seq = _ops.per_sample_masked_mean(log_ratio, _ops.cat(loss_masks), lengths)
        log_ratio = seq[_ops.sample_ids(lengths, seq.device)]
    ratio = torch.exp(log_ratio)
    keep = (ratio >= mis.lo) & (ratio <= mis.hi)
    return _ops.split(keep.float(), lengths)


def compute_mismatch_weights(
    old_log_probs: list[Tensor],
    rollout_log_probs: list[Tensor],
    loss_masks: list[Tensor],
    correction: Mismatch | None,
    settings: LossSettings | None = None,
) -> tuple[list[Tensor] | None, dict[str, Tensor]]:
    """Per-token weights for the policy loss (None when `correction` is None) and mismatch metrics as
    (numerator, count) pairs over loss tokens:

    - ``train_rollout_logprob_abs_diff``: mean |old - rollout|   (always)
    - ``ois``: mean unclipped ratio exp(old - rollout)            (always)
    - ``tis``: mean TIS weight; ``tis_clipfrac``: fraction of tokens whose ratio was clipped   (TIS)
    - ``mis_masked_frac``: fraction of loss tokens dropped by MIS, at either level             (MIS)

    A CustomMismatch's function replaces TIS and MIS (called as ``fn(old, rollout, masks, settings)``). Values
    at mask-0 positions are set to 0 first (so weights there are finite and metrics never read them).
    """
    _ops.check_aligned("old_log_probs", old_log_probs, loss_masks)
    _ops.check_aligned("rollout_log_probs", rollout_log_probs, loss_masks)
    old_log_probs = _ops.masked_list(old_log_probs, loss_masks)
    rollout_log_probs = _ops.masked_list(rollout_log_probs, loss_masks)
    mask = _ops.cat(loss_masks)
    log_ratio = (_ops.cat(old_log_probs).float() - _ops.cat(rollout_log_probs).float()).detach()
    ratio = torch.exp(log_ratio)
    metrics = {
        "train_rollout_logprob_abs_diff": masked_metric(log_ratio.abs(), mask),
        "ois": masked_metric(ratio, mask),
    }
    if isinstance(correction, CustomMismatch):
        if settings is None:
            raise ValueError("a CustomMismatch passes the LossSettings to its function: give `settings`")
        custom_weights, custom_metrics = correction.fn(old_log_probs, rollout_log_probs, loss_masks, settings)
        _ops.check_aligned("custom TIS weights", custom_weights, loss_masks)
        metrics.update(custom_metrics)
        return [w.detach().float() for w in custom_weights], metrics
    tis = correction.tis if isinstance(correction, TISAndMIS) else correction
    mis = correction.mis if isinstance(correction, TISAndMIS) else correction
    weights: list[Tensor] | None = None
    if isinstance(tis, TIS):
        weights = compute_tis_weights(old_log_probs, rollout_log_probs, tis)
        metrics["tis"] = masked_metric(_ops.cat(weights), mask)
        metrics["tis_clipfrac"] = masked_metric(((ratio < tis.lo) | (ratio > tis.hi)).float(), mask)
    if isinstance(mis, MIS):
        keep = compute_mis_mask(old_log_probs, rollout_log_probs, loss_masks, mis)
        metrics["mis_masked_frac"] = masked_metric(1.0 - _ops.cat(keep), mask)
        weights = keep if weights is None else [w * k for w, k in zip(weights, keep)]
    return weights, metrics
