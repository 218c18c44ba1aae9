"""Clipped policy-gradient losses (PPO token ratio, GSPO sequence ratio) and OPSM sequence masking.

All functions return PER-TOKEN values; how they are reduced to a scalar (and what that divides by) is the job
of miles.algo.reductions. Sign convention: ``ppo_kl = old_log_probs - log_probs`` (log pi_old - log pi_theta at
the sampled tokens), so ``ratio = exp(-ppo_kl) = pi_theta / pi_old``.

The log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20] before `exp` (as verl and OpenRLHF
do): exp(89) overflows float32, and the backward of a clipped token (whose loss does not depend on the ratio)
would then compute 0 * inf = nan for every parameter. Inside the clamp nothing changes; beyond it the ratio is
e^{+-20}, far outside any clip range. Values at loss-mask-0 positions are set to 0 before any arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.registry import Registry

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class OPSM:
    """Off-policy sequence masking (`compute_opsm_mask`): mask a negative-advantage sample whose sequence KL
    from the behaviour policy exceeds `delta`."""

    delta: float = 1e-4

    def __post_init__(self) -> None:
        if self.delta < 0:
            raise ValueError(f"opsm_delta={self.delta} must be >= 0")


@dataclass(frozen=True)
class PolicyLossSpec:
    """Which registered policy loss (``--policy-loss``), its clip range, what its ratio is taken against and
    the OPSM mask on top of it."""

    name: str = "ppo"  # registered policy loss: ppo | gspo | a user-registered one
    eps_clip: float = 0.2  # lower clip: ratio >= 1 - eps_clip
    eps_clip_high: float | None = None  # upper clip: ratio <= 1 + eps_clip_high; None = eps_clip
    eps_clip_c: float | None = None  # dual-clip bound (> 1) for negative advantages; None = off
    use_rollout_logprobs: bool = False  # ratio against the rollout log-probs instead of the old log-probs
    opsm: OPSM | None = None  # off-policy sequence masking; None = off

    def __post_init__(self) -> None:
        errors = []
        if self.name not in POLICY_LOSSES:
            errors.append(f"policy_loss={self.name!r} not in {POLICY_LOSSES.names()}")
        if self.eps_clip < 0 or self.clip_high < 0:
            errors.append(f"eps_clip={self.eps_clip} and eps_clip_high={self.eps_clip_high} must be >= 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            errors.append(f"eps_clip_c={self.eps_clip_c} must be > 1 (dual-clip bound on the ratio) or None")
        if errors:
            raise ValueError("invalid policy loss: " + "; ".join(errors))

    @property
    def clip_high(self) -> float:
        """The effective upper clip epsilon."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def compute_policy_loss(ppo_kl: Tensor, advantages: Tensor, spec: PolicyLossSpec) -> tuple[Tensor, Tensor]:
    """Per-token PPO clipped surrogate loss and clip indicator (same shape as the inputs), with the clip range
    of `spec` (eps_clip, clip_high, eps_clip_c).

    ratio = exp(clamp(-ppo_kl, -20, 20));  loss = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high)).
    Dual clip (``eps_clip_c`` > 1, Ye et al. 2020): for tokens with A < 0 the loss is further capped,
    loss = min(loss, -A * eps_clip_c), so a huge ratio on a bad token cannot produce an unbounded update.

    Returns ``(per_token_loss, per_token_clipfrac)`` where clipfrac is 1.0 where the clipped term is strictly
    larger than the unclipped one (the ratio is outside the trust region in the direction that matters, so the
    token gets no gradient), else 0.0. Gradient flows through `ppo_kl` only; a token whose log-ratio lies
    beyond the +-20 clamp gets exactly zero gradient (never nan).
    """
    if ppo_kl.shape != advantages.shape:
        raise ValueError(f"ppo_kl shape {tuple(ppo_kl.shape)} != advantages shape {tuple(advantages.shape)}")
    advantages = advantages.detach().float()
    ratio = torch.exp((-ppo_kl.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - spec.eps_clip, 1.0 + spec.clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if spec.eps_clip_c is not None:
        capped = torch.minimum(loss, -advantages * spec.eps_clip_c)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipfrac


@dataclass
class PolicyLossOutputs:
    loss: list[Tensor]  # B x [L_i] per-token loss (differentiable)
    clipfrac: list[Tensor]  # B x [L_i] 1.0 where clipped
    ppo_kl: list[Tensor]  # B x [L_i] the (detached) old - new log-ratio the clip acted on


# fn(log_probs, old_log_probs, advantages, loss_masks, spec), the first four per-sample lists B x [L_i]
PolicyLossFn = Callable[
    [list[Tensor], list[Tensor], list[Tensor], list[Tensor], PolicyLossSpec], PolicyLossOutputs
]


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a per-token policy loss under `name` (``--policy-loss``).

    Signature: ``fn(log_probs, old_log_probs, advantages, loss_masks, spec) -> PolicyLossOutputs``, the first
    four per-sample lists ``B x [L_i]`` and `spec` the PolicyLossSpec (clip range: `compute_policy_loss`).
    """
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The registered policy loss `name` (ValueError listing the choices on a miss)."""
    return POLICY_LOSSES.get(name)


def _check(
    log_probs: list[Tensor], old_log_probs: list[Tensor], advantages: list[Tensor], masks: list[Tensor]
) -> None:
    _ops.check_aligned("log_probs", log_probs, masks)
    _ops.check_aligned("old_log_probs", old_log_probs, masks)
    _ops.check_aligned("advantages", advantages, masks)


def _masked_inputs(
    log_probs: list[Tensor], old_log_probs: list[Tensor], advantages: list[Tensor], masks: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenated float32 (new, old, advantages) with 0 at every mask-0 position (selected, not multiplied)."""
    new, old, adv = (
        _ops.masked_cat(values, masks).float() for values in (log_probs, old_log_probs, advantages)
    )
    return new, old, adv


def _clipped_ratio_loss(
    log_probs: list[Tensor],
    old_log_probs: list[Tensor],
    advantages: list[Tensor],
    loss_masks: list[Tensor],
    spec: PolicyLossSpec,
    *,
    sequence_ratio: bool,
) -> PolicyLossOutputs:
    """The clipped-ratio loss PPO and GSPO both are: `compute_policy_loss` on a log-ratio per token (PPO) or
    per sequence (GSPO).

    PPO/GRPO: token-level ratio pi_theta(x_t) / pi_old(x_t), clipped per token.

    GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean_t (log pi_theta - log pi_old)) with the mean
    over sample i's loss tokens, clipped per sequence (GSPO uses much smaller eps than PPO). Stop-gradient trick
    (GSPO-token): each token uses ``log s_i,t = log pi_theta(x_t) - sg[log pi_theta(x_t)] + sg[log s_i]``, whose
    VALUE is log s_i for every token while its gradient is that of log pi_theta(x_t). Hence
    d s_i,t = s_i * d log pi_theta(x_t) per token, and a per-sample token mean of the loss has exactly the
    gradient of the sequence-level objective -A_i * s_i (for advantages constant over the sequence) while
    advantages may still vary per token. Reported ppo_kl is the per-sequence value -log s_i broadcast to the
    tokens.
    """
    _check(log_probs, old_log_probs, advantages, loss_masks)
    lengths = _ops.lengths_of(loss_masks)
    new, old, adv = _masked_inputs(log_probs, old_log_probs, advantages, loss_masks)
    old = old.detach()
    if sequence_ratio:
        mask = _ops.cat(loss_masks)
        seq_log_ratio = _ops.per_sample_masked_mean((new - old).detach(), mask, lengths)
        ppo_kl = -(new - new.detach() + seq_log_ratio[_ops.sample_ids(lengths, new.device)])
    else:
        ppo_kl = old - new
    loss, clipfrac = compute_policy_loss(ppo_kl, adv, spec)
    return PolicyLossOutputs(
        loss=_ops.split(loss, lengths),
        clipfrac=_ops.split(clipfrac, lengths),
        ppo_kl=_ops.split(ppo_kl.detach(), lengths),
    )


ppo_policy_loss = POLICY_LOSSES.add("ppo", functools.partial(_clipped_ratio_loss, sequence_ratio=False))
gspo_policy_loss = POLICY_LOSSES.add("gspo", functools.partial(_clipped_ratio_loss, sequence_ratio=True))


def compute_opsm_mask(
    log_probs: list[Tensor],
    behaviour_log_probs: list[Tensor],
    advantages: list[Tensor],
    loss_masks: list[Tensor],
    opsm: OPSM,
) -> list[Tensor]:
    """Off-policy sequence masking (OPSM, DeepSeek-V3.2): per-token 0/1 weights, constant within a sample.

    For sample i, with the means taken over its loss tokens (mask == 1) and everything detached:
      seq_kl_i = mean_t (behaviour_log_probs - log_probs)   (log pi_behaviour - log pi_theta: a sampled
                                                              estimate of KL(pi_behaviour || pi_theta))
      adv_i    = mean_t advantages
    the whole sample is masked (weight 0) iff ``adv_i < 0`` and ``seq_kl_i > opsm.delta``; otherwise weight 1.
    `behaviour_log_probs` is the policy that generated the tokens: the rollout log-probs when available, else
    the old (pre-update) log-probs. Rationale: negative samples that drifted far off-policy give the most
    harmful, high-variance updates, while positive ones are kept. Samples without loss tokens get weight 1.
    """
    _check(log_probs, behaviour_log_probs, advantages, loss_masks)
    lengths = _ops.lengths_of(loss_masks)
    if not lengths:
        return []
    mask = _ops.cat(loss_masks)
    new, behaviour, adv = _masked_inputs(log_probs, behaviour_log_probs, advantages, loss_masks)
    seq_kl = _ops.per_sample_masked_mean((behaviour - new).detach(), mask, lengths)
    seq_adv = _ops.per_sample_masked_mean(adv.detach(), mask, lengths)
    keep = ~((seq_adv < 0) & (seq_kl > opsm.delta))
    return _ops.split(keep.float()[_ops.sample_ids(lengths, mask.device)], lengths)
