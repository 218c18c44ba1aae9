"""The composed RL loss of one micro-batch: policy gradient (+ mismatch weights) - entropy bonus + KL penalty.

The backend calls `compute_loss` (or a user function loaded with `load_custom_loss`) once per micro-batch and
backpropagates the returned scalar; it never assembles the loss itself. Inputs are per-sample lists
``B x [L_i]`` over response tokens. `log_probs` and `entropy` must be computed by the backend with
miles.algo.logprobs at the ROLLOUT temperature (logits / temperature, float32), the same convention as the
engine's log-probs, so that ratios against old / rollout log-probs are meaningful.

    loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss

each term reduced with the same named reduction and `denominator` (miles.algo.reductions: what it divides by
and why it carries 1/dp_size). Metrics are (numerator, count) pairs (miles.algo.metrics):

- ``loss``, ``pg_loss``, ``entropy_loss`` (if entropy is given), ``kl_loss`` (with a KLPenalty): under the
  reduction, so their finalized value over a step equals the step's objective terms;
- ``pg_clipfrac``, ``ppo_kl``: means over loss tokens;
- ``opsm_masked_frac`` (with OPSM): fraction of loss tokens in sequences masked by OPSM;
- with rollout log-probs: ``train_rollout_logprob_abs_diff``, ``ois`` and, with a mismatch correction,
  ``tis``, ``tis_clipfrac``, ``mis_masked_frac`` or the custom function's (miles.algo.mismatch).

The settings are records (`LossSettings` of a PolicyLossSpec, a KLPenalty, a Mismatch and a LossReduction);
custom functions arrive as callables: the trainer resolves the user's paths once, miles.algo loads nothing.

Values at loss-mask-0 positions of every input are replaced by 0 (selected, not multiplied) before any
arithmetic, so nan/inf there reaches neither the loss, its gradient, nor a metric.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.kl import KLPenalty, compute_approx_kl
from miles.algo.metrics import masked_metric
from miles.algo.mismatch import Mismatch, compute_mismatch_weights
from miles.algo.policy_loss import PolicyLossSpec, compute_opsm_mask, get_policy_loss
from miles.algo.reductions import LossReduction, reduce_loss_and_metric


@dataclass
class LossInputs:
    """One micro-batch, per sample (B samples, L_i response tokens each)."""

    log_probs: list[Tensor]  # B x [L_i] current policy, differentiable
    old_log_probs: list[Tensor]  # B x [L_i] trainer log-probs before this step's updates (detached)
    advantages: list[Tensor]  # B x [L_i]
    loss_masks: list[Tensor]  # B x [L_i] 1 = trained on
    ref_log_probs: list[Tensor] | None = None  # B x [L_i] reference model; needed when use_kl_loss
    rollout_log_probs: list[Tensor] | None = None  # B x [L_i] from the engine; needed for TIS/MIS
    entropy: list[Tensor] | None = None  # B x [L_i] differentiable; needed when entropy_coef != 0

    def __post_init__(self) -> None:
        for name in (
            "log_probs",
            "old_log_probs",
            "advantages",
            "ref_log_probs",
            "rollout_log_probs",
            "entropy",
        ):
            values = getattr(self, name)
            if values is not None:
                _ops.check_aligned(name, values, self.loss_masks)
        if not self.loss_masks:
            raise ValueError("LossInputs needs at least one sample")


@dataclass(frozen=True)
class LossSettings:
    """What `compute_loss` computes, one record per choice. The reduction's `denominator` changes every step
    (it depends on the step's global sample / token counts): see `LossReduction`."""

    policy: PolicyLossSpec = PolicyLossSpec()
    kl: KLPenalty | None = None  # add kl.coef * KL(pi || pi_ref); None = no KL term
    entropy_coef: float = 0.0  # entropy bonus weight
    mismatch: Mismatch | None = None  # TIS | MIS | TISAndMIS | CustomMismatch against rollout log-probs
    reduction: LossReduction = LossReduction()

    def __post_init__(self) -> None:
        if self.policy.use_rollout_logprobs and self.mismatch is not None:
            raise ValueError(
                "use_rollout_logprobs makes the PPO ratio relative to the rollout policy already; a mismatch "
                f"correction ({type(self.mismatch).__name__}) would correct for the same mismatch twice"
            )


# fn(inputs, settings) -> (loss, metrics): `compute_loss`, or the user's ``--custom-loss-function-path``: `loss`
# a differentiable scalar already divided as settings.reduction prescribes (miles.algo.reductions) and
# `metrics` (numerator, count) pairs (miles.algo.metrics). A custom loss may call `compute_loss`.
LossFn = Callable[[LossInputs, LossSettings], tuple[Tensor, dict[str, Tensor]]]


def mask_loss_inputs(inputs: LossInputs) -> LossInputs:
    """A copy of `inputs` with every per-token value at a loss-mask-0 position set to 0 (gradients there are 0).

    `compute_loss` applies it first; a custom loss may call it too."""
    masks = inputs.loss_masks
    replaced = {
        f.name: _ops.masked_list(getattr(inputs, f.name), masks)
        for f in dataclasses.fields(inputs)
        if f.name != "loss_masks" and getattr(inputs, f.name) is not None
    }
    return dataclasses.replace(inputs, **replaced)


def compute_loss(inputs: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss of one micro-batch and its metrics ((numerator, count) pairs); see the module docstring."""
    inputs = mask_loss_inputs(inputs)
    metrics: dict[str, Tensor] = {}
    terms = [(1.0, "pg_loss", _policy_token_losses(inputs, settings, metrics))]
    terms += _regulariser_terms(inputs, settings)
    loss = torch.zeros((), dtype=torch.float32, device=inputs.loss_masks[0].device)
    loss_num = torch.zeros((), dtype=torch.float64)
    r = settings.reduction
    for coef, name, values in terms:
        term, pair = reduce_loss_and_metric(r.kind, values, inputs.loss_masks, r.denominator, r.constant)
        metrics[name] = pair
        loss = loss + coef * term
        loss_num = loss_num.to(pair.device) + coef * pair[0]
    metrics["loss"] = torch.stack([loss_num, pair[1]])  # every term shares the reduction's count
    return loss, metrics


def _policy_token_losses(
    inputs: LossInputs, settings: LossSettings, metrics: dict[str, Tensor]
) -> list[Tensor]:
    """Per-token policy-gradient loss with OPSM and the mismatch weights applied; adds their metrics."""
    masks = inputs.loss_masks
    spec = settings.policy
    if settings.mismatch is not None and inputs.rollout_log_probs is None:
        raise ValueError(
            f"the mismatch correction {type(settings.mismatch).__name__} needs rollout_log_probs, got None"
        )
    old = inputs.old_log_probs
    if spec.use_rollout_logprobs:
        old = _require(inputs.rollout_log_probs, "rollout_log_probs", "use_rollout_logprobs")
    pg = get_policy_loss(spec.name)(inputs.log_probs, old, inputs.advantages, masks, spec)
    flat_mask = _ops.cat(masks)
    metrics["pg_clipfrac"] = masked_metric(_ops.cat(pg.clipfrac), flat_mask)
    metrics["ppo_kl"] = masked_metric(_ops.cat(pg.ppo_kl), flat_mask)
    token_losses = pg.loss
    if spec.opsm is not None:
        behaviour = inputs.rollout_log_probs if inputs.rollout_log_probs is not None else inputs.old_log_probs
        keep = compute_opsm_mask(inputs.log_probs, behaviour, inputs.advantages, masks, spec.opsm)
        metrics["opsm_masked_frac"] = masked_metric(1.0 - _ops.cat(keep), flat_mask)
        token_losses = [x * k for x, k in zip(token_losses, keep)]
    if inputs.rollout_log_probs is not None:
        weights, mismatch_metrics = compute_mismatch_weights(
            inputs.old_log_probs, inputs.rollout_log_probs, masks, settings.mismatch, settings
        )
        metrics.update(mismatch_metrics)
        if weights is not None:
            token_losses = [x * w for x, w in zip(token_losses, weights)]
    return token_losses


def _regulariser_terms(inputs: LossInputs, settings: LossSettings) -> list[tuple[float, str, list[Tensor]]]:
    """(coefficient, metric name, per-token values) of the entropy bonus and the KL penalty."""
    terms = []
    if inputs.entropy is not None:
        terms.append((-settings.entropy_coef, "entropy_loss", inputs.entropy))
    elif settings.entropy_coef != 0:
        raise ValueError(f"entropy_coef={settings.entropy_coef} needs entropy, got None")
    if settings.kl is not None:
        penalty = settings.kl
        ref = _require(inputs.ref_log_probs, "ref_log_probs", "a KL penalty (use_kl_loss)")
        olds = inputs.old_log_probs if penalty.unbiased else [None] * len(ref)
        kl = [compute_approx_kl(lp, r, penalty.type, old) for lp, r, old in zip(inputs.log_probs, ref, olds)]
        terms.append((penalty.coef, "kl_loss", kl))
    return terms


def _require(values: list[Tensor] | None, name: str, flag: str) -> list[Tensor]:
    if values is None:
        raise ValueError(f"{flag} needs {name}, got None")
    return values
