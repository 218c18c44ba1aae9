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
from typing import Any

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.metrics import masked_metric
from miles.utils.misc import load_function

MIS_LEVELS = ("token", "sequence")

# fn(old_log_probs, rollout_log_probs, loss_masks, settings) -> (weights B x [L_i], metrics {name: (num, count)})
CustomTISFn = Callable[
    [list[Tensor], list[Tensor], list[Tensor], Any], tuple[list[Tensor], dict[str, Tensor]]
]


def compute_tis_weights(
    old_log_probs: list[Tensor], rollout_log_probs: list[Tensor], clip_low: float, clip_high: float
) -> list[Tensor]:
    """Per-token truncated importance weights clip(exp(old - rollout), clip_low, clip_high), detached."""
    if not 0 <= clip_low <= clip_high:
        raise ValueError(f"need 0 <= tis_clip_low ({clip_low}) <= tis_clip ({clip_high})")
    _ops.check_aligned("old_log_probs", old_log_probs, rollout_log_probs, "rollout_log_probs")
    return [
        torch.exp(o.detach().float() - r.detach().float()).clamp(clip_low, clip_high)
        for o, r in zip(old_log_probs, rollout_log_probs)
    ]


def compute_mis_mask(
    old_log_probs: list[Tensor],
    rollout_log_probs: list[Tensor],
    loss_masks: list[Tensor],
    level: str,
    lower: float,
    upper: float,
) -> list[Tensor]:
    """Per-token 0/1 masked importance sampling (MIS) weights; 0 = dropped.

    level "token": drop token t iff exp(old_t - rollout_t) is outside [lower, upper].
    level "sequence": drop every token of sample i iff its geometric-mean ratio
    exp(mean_t (old_t - rollout_t)) (mean over the sample's loss tokens) is outside [lower, upper].
    Values at mask-0 positions are not read (those positions get weight 1 at level "token").
    """
    if level not in MIS_LEVELS:
        raise ValueError(f"mis_level={level!r}; choose one of {list(MIS_LEVELS)}")
    if not 0 <= lower <= upper:
        raise ValueError(f"need 0 <= mis_lower ({lower}) <= mis_upper ({upper})")
    _ops.check_aligned("old_log_probs", old_log_probs, loss_masks)
    _ops.check_aligned("rollout_log_probs", rollout_log_probs, loss_masks)
    lengths = _ops.lengths_of(loss_masks)
    if not lengths:
        return []
    old_log_probs = _ops.masked_list(old_log_probs, loss_masks)
    rollout_log_probs = _ops.masked_list(rollout_log_probs, loss_masks)
    log_ratio = (_ops.cat(old_log_probs).float() - _ops.cat(rollout_log_probs).float()).detach()
    if level == "sequence":
        seq = _ops.per_sample_masked_mean(log_ratio, _ops.cat(loss_masks), lengths)
        log_ratio = seq[_ops.sample_ids(lengths, seq.device)]
    ratio = torch.exp(log_ratio)
    keep = (ratio >= lower) & (ratio <= upper)
    return _ops.split(keep.float(), lengths)


def load_custom_tis_function(path: str) -> CustomTISFn:
    """Load ``--custom-tis-function-path`` (``module.path:fn``).

    Signature: ``fn(old_log_probs, rollout_log_probs, loss_masks, settings) -> (weights, metrics)`` with the
    first three ``B x [L_i]`` lists, `settings` the LossSettings, `weights` one per-token tensor per sample
    (detached by the caller; it REPLACES the built-in TIS and MIS weights) and `metrics` a dict of
    (numerator, count) pairs (see miles.algo.metrics), merged into the loss metrics.
    """
    return load_function(path, "--custom-tis-function-path")


def compute_mismatch_weights(
    old_log_probs: list[Tensor],
    rollout_log_probs: list[Tensor],
    loss_masks: list[Tensor],
    *,
    use_tis: bool,
    tis_clip_low: float,
    tis_clip: float,
    use_mis: bool,
    mis_level: str,
    mis_lower: float,
    mis_upper: float,
    custom_fn: CustomTISFn | None = None,
    settings: Any = None,
) -> tuple[list[Tensor] | None, dict[str, Tensor]]:
    """Per-token weights for the policy loss (None when neither TIS, MIS nor a custom function is on) and
    mismatch metrics as (numerator, count) pairs over loss tokens:

    - ``train_rollout_logprob_abs_diff``: mean |old - rollout|   (always)
    - ``ois``: mean unclipped ratio exp(old - rollout)            (always)
    - ``tis``: mean TIS weight; ``tis_clipfrac``: fraction of tokens whose ratio was clipped   (use_tis)
    - ``mis_masked_frac``: fraction of loss tokens dropped by MIS, at either level             (use_mis)

    A `custom_fn` replaces TIS and MIS (called as ``custom_fn(old, rollout, masks, settings)``). Values at
    mask-0 positions are set to 0 first (so weights there are finite and metrics never read them).
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
    if custom_fn is not None:
        custom_weights, custom_metrics = custom_fn(old_log_probs, rollout_log_probs, loss_masks, settings)
        _ops.check_aligned("custom TIS weights", custom_weights, loss_masks)
        metrics.update(custom_metrics)
        return [w.detach().float() for w in custom_weights], metrics
    weights: list[Tensor] | None = None
    if use_tis:
        weights = compute_tis_weights(old_log_probs, rollout_log_probs, tis_clip_low, tis_clip)
        metrics["tis"] = masked_metric(_ops.cat(weights), mask)
        metrics["tis_clipfrac"] = masked_metric(((ratio < tis_clip_low) | (ratio > tis_clip)).float(), mask)
    if use_mis:
        keep = compute_mis_mask(old_log_probs, rollout_log_probs, loss_masks, mis_level, mis_lower, mis_upper)
        metrics["mis_masked_frac"] = masked_metric(1.0 - _ops.cat(keep), mask)
        weights = keep if weights is None else [w * k for w, k in zip(weights, keep)]
    return weights, metrics
