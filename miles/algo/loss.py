"""The composed RL loss of one micro-batch: policy gradient (+ mismatch weights) - entropy bonus + KL penalty.

The backend calls `compute_loss` (or a user function loaded with `load_custom_loss`) once per micro-batch and
backpropagates the returned scalar; it never assembles the loss itself. Inputs are per-sample lists
``B x [L_i]`` over response tokens. `log_probs` and `entropy` must be computed by the backend with
miles.algo.logprobs at the ROLLOUT temperature (logits / temperature, float32), the same convention as the
engine's log-probs, so that ratios against old / rollout log-probs are meaningful.

    loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss

each term reduced with the same named reduction and `denominator` (miles.algo.reductions: what it divides by
and why it carries 1/dp_size). Metrics are (numerator, count) pairs (miles.algo.metrics):

- ``loss``, ``pg_loss``, ``entropy_loss`` (if entropy is given), ``kl_loss`` (if use_kl_loss): under the
  reduction, so their finalized value over a step equals the step's objective terms;
- ``pg_clipfrac``, ``ppo_kl``: means over loss tokens;
- ``opsm_masked_frac`` (use_opsm): fraction of loss tokens in sequences masked by OPSM;
- with rollout log-probs: ``train_rollout_logprob_abs_diff``, ``ois`` and, when enabled, ``tis``,
  ``tis_clipfrac``, ``mis_masked_frac`` (miles.algo.mismatch).

Values at loss-mask-0 positions of every input are replaced by 0 (selected, not multiplied) before any
arithmetic, so nan/inf there reaches neither the loss, its gradient, nor a metric.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.kl import KL_TYPES, compute_approx_kl
from miles.algo.metrics import masked_metric
from miles.algo.mismatch import MIS_LEVELS, CustomTISFn, compute_mismatch_weights, load_custom_tis_function
from miles.algo.policy_loss import POLICY_LOSSES, compute_opsm_mask, get_policy_loss
from miles.algo.reductions import REDUCTIONS, reduce_loss_and_metric
from miles.utils.misc import load_function


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
    """Plain values configuring `compute_loss`. `denominator` changes every step (it depends on the step's
    global sample / token counts): build it with ``dataclasses.replace(settings, denominator=...)``."""

    policy_loss: str = "ppo"  # registered policy loss: ppo | gspo
    eps_clip: float = 0.2  # lower clip: ratio >= 1 - eps_clip
    eps_clip_high: float | None = None  # upper clip: ratio <= 1 + eps_clip_high; None = eps_clip
    eps_clip_c: float | None = None  # dual-clip bound (> 1) for negative advantages; None = off
    use_opsm: bool = False  # off-policy sequence masking
    opsm_delta: float = 1e-4  # OPSM threshold on the per-sequence KL
    use_kl_loss: bool = False  # add kl_loss_coef * KL(pi || pi_ref) to the loss
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 | low_var_kl
    use_unbiased_kl: bool = False  # importance-weight the KL by pi / pi_old (miles.algo.kl)
    entropy_coef: float = 0.0  # entropy bonus weight
    use_tis: bool = False  # truncated importance sampling against rollout log-probs
    tis_clip: float = 2.0  # upper truncation of the TIS weight
    tis_clip_low: float = 0.0  # lower truncation of the TIS weight
    use_mis: bool = False  # masked importance sampling
    mis_level: str = "token"  # token | sequence
    mis_lower: float = 0.5  # keep ratios >= mis_lower
    mis_upper: float = 2.0  # keep ratios <= mis_upper
    custom_tis_fn: str | None = None  # --custom-tis-function-path ('module:fn'), replaces TIS/MIS weights
    use_rollout_logprobs: bool = False  # PPO ratio against rollout log-probs instead of old log-probs
    reduction: str = "sample_mean"  # sample_mean | token_mean | constant_sum
    reduction_constant: float | None = None  # constant_sum's constant (e.g. max response length)
    denominator: float = 1.0  # from miles.algo.reductions.reduction_denominator

    def __post_init__(self) -> None:
        errors = []
        if self.policy_loss not in POLICY_LOSSES:
            errors.append(f"policy_loss={self.policy_loss!r} not in {POLICY_LOSSES.names()}")
        if self.eps_clip < 0 or (self.eps_clip_high is not None and self.eps_clip_high < 0):
            errors.append(f"eps_clip={self.eps_clip}, eps_clip_high={self.eps_clip_high} must be >= 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            errors.append(f"eps_clip_c={self.eps_clip_c} must be > 1 or None")
        if self.opsm_delta < 0:
            errors.append(f"opsm_delta={self.opsm_delta} must be >= 0")
        if self.kl_loss_type not in KL_TYPES:
            errors.append(f"kl_loss_type={self.kl_loss_type!r} not in {list(KL_TYPES)}")
        if not 0 <= self.tis_clip_low <= self.tis_clip:
            errors.append(f"need 0 <= tis_clip_low ({self.tis_clip_low}) <= tis_clip ({self.tis_clip})")
        if self.mis_level not in MIS_LEVELS:
            errors.append(f"mis_level={self.mis_level!r} not in {list(MIS_LEVELS)}")
        if not 0 <= self.mis_lower <= self.mis_upper:
            errors.append(f"need 0 <= mis_lower ({self.mis_lower}) <= mis_upper ({self.mis_upper})")
        if self.use_rollout_logprobs and (self.use_tis or self.use_mis or self.custom_tis_fn):
            errors.append(
                "use_rollout_logprobs makes the PPO ratio relative to the rollout policy already; "
                "use_tis / use_mis / custom_tis_fn would correct for the same mismatch twice"
            )
        if self.reduction not in REDUCTIONS:
            errors.append(f"reduction={self.reduction!r} not in {REDUCTIONS.names()}")
        if self.reduction == "constant_sum" and not (self.reduction_constant or 0) > 0:
            errors.append(
                f"reduction constant_sum needs reduction_constant > 0, got {self.reduction_constant}"
            )
        if not self.denominator > 0:
            errors.append(f"denominator={self.denominator} must be > 0")
        if errors:
            raise ValueError("invalid loss settings:\n  " + "\n  ".join(errors))

    @property
    def clip_high(self) -> float:
        """The effective upper clip epsilon."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


LossFn = Callable[[LossInputs, LossSettings], tuple[Tensor, dict[str, Tensor]]]


@functools.lru_cache(maxsize=8)
def _custom_tis(path: str) -> CustomTISFn:
    return load_custom_tis_function(path)


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
    for coef, name, values in terms:
        term, pair = reduce_loss_and_metric(
            settings.reduction, values, inputs.loss_masks, settings.denominator, settings.reduction_constant
        )
        metrics[name] = pair
        loss = loss + coef * term
        loss_num = loss_num.to(pair.device) + coef * pair[0]
    metrics["loss"] = torch.stack([loss_num, pair[1]])  # every term shares the reduction's count
    return loss, metrics


def _policy_token_losses(
    inputs: LossInputs, settings: LossSettings, metrics: dict[str, Tensor]
) -> list[Tensor]:
    """Per-token policy-gradient loss with OPSM and TIS/MIS weights applied; adds their metrics."""
    masks = inputs.loss_masks
    uses_mismatch = settings.use_tis or settings.use_mis or bool(settings.custom_tis_fn)
    if uses_mismatch and inputs.rollout_log_probs is None:
        raise ValueError("use_tis / use_mis / custom_tis_fn need rollout_log_probs, got None")
    old = inputs.old_log_probs
    if settings.use_rollout_logprobs:
        old = _require(inputs.rollout_log_probs, "rollout_log_probs", "use_rollout_logprobs")
    pg = get_policy_loss(settings.policy_loss)(
        inputs.log_probs,
        old,
        inputs.advantages,
        masks,
        eps_clip=settings.eps_clip,
        eps_clip_high=settings.clip_high,
        eps_clip_c=settings.eps_clip_c,
    )
    flat_mask = _ops.cat(masks)
    metrics["pg_clipfrac"] = masked_metric(_ops.cat(pg.clipfrac), flat_mask)
    metrics["ppo_kl"] = masked_metric(_ops.cat(pg.ppo_kl), flat_mask)
    token_losses = pg.loss
    if settings.use_opsm:
        behaviour = inputs.rollout_log_probs if inputs.rollout_log_probs is not None else inputs.old_log_probs
        keep = compute_opsm_mask(inputs.log_probs, behaviour, inputs.advantages, masks, settings.opsm_delta)
        metrics["opsm_masked_frac"] = masked_metric(1.0 - _ops.cat(keep), flat_mask)
        token_losses = [x * k for x, k in zip(token_losses, keep)]
    if inputs.rollout_log_probs is not None:
        weights, mismatch_metrics = compute_mismatch_weights(
            inputs.old_log_probs,
            inputs.rollout_log_probs,
            masks,
            use_tis=settings.use_tis,
            tis_clip_low=settings.tis_clip_low,
            tis_clip=settings.tis_clip,
            use_mis=settings.use_mis,
            mis_level=settings.mis_level,
            mis_lower=settings.mis_lower,
            mis_upper=settings.mis_upper,
            custom_fn=_custom_tis(settings.custom_tis_fn) if settings.custom_tis_fn else None,
            settings=settings,
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
    if settings.use_kl_loss:
        ref = _require(inputs.ref_log_probs, "ref_log_probs", "use_kl_loss")
        olds = inputs.old_log_probs if settings.use_unbiased_kl else [None] * len(ref)
        kl = [
            compute_approx_kl(lp, r, settings.kl_loss_type, old)
            for lp, r, old in zip(inputs.log_probs, ref, olds)
        ]
        terms.append((settings.kl_loss_coef, "kl_loss", kl))
    return terms


def _require(values: list[Tensor] | None, name: str, flag: str) -> list[Tensor]:
    if values is None:
        raise ValueError(f"{flag} needs {name}, got None")
    return values


def load_custom_loss(path: str) -> LossFn:
    """Load ``--custom-loss-function-path`` (``module.path:fn``) to use instead of `compute_loss`.

    Signature: ``fn(inputs: LossInputs, settings: LossSettings) -> (loss, metrics)``: `loss` a differentiable
    scalar already divided as the settings' reduction / denominator prescribe (see miles.algo.reductions) and
    `metrics` a dict of (numerator, count) pairs (miles.algo.metrics). A custom loss may call `compute_loss`.
    """
    return load_function(path, "--custom-loss-function-path")
