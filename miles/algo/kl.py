"""Per-token KL estimators between the current policy and a reference policy.

With `log_ratio = log_probs - ref_log_probs` (log pi(x_t) - log pi_ref(x_t), evaluated at the sampled token
x_t ~ pi), the estimators of KL(pi || pi_ref) are (Schulman, "Approximating KL divergence"):

- ``k1``: ``log_ratio``. Unbiased, high variance, can be negative.
- ``k2``: ``0.5 * log_ratio**2``. Biased, low variance, >= 0.
- ``k3``: ``exp(-log_ratio) - 1 + log_ratio`` (= ratio - 1 - log ratio with ratio = pi_ref / pi). Unbiased,
  >= 0.
- ``low_var_kl``: ``k3`` computed from a log-ratio clamped to [-20, 20] (so exp cannot overflow to inf and
  poison the backward pass with NaN) and then clamped to [-10, 10]. Since k3 >= 0 only the upper bound ever
  acts: a single token cannot contribute more than 10 nats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

_LOW_VAR_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def _low_var_kl(log_ratio: Tensor) -> Tensor:
    clamped = log_ratio.clamp(-_LOW_VAR_LOG_RATIO_CLAMP, _LOW_VAR_LOG_RATIO_CLAMP)
    return _k3(clamped).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)


_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3, "low_var_kl": _low_var_kl}
KL_TYPES = tuple(_ESTIMATORS)


def _estimator(kl_type: str) -> Callable[[Tensor], Tensor]:
    estimator = _ESTIMATORS.get(kl_type)
    if estimator is None:
        raise ValueError(f"unknown kl_type {kl_type!r}; choose one of {list(KL_TYPES)}")
    return estimator


@dataclass(frozen=True)
class KLPenalty:
    """The KL(pi || pi_ref) term of the loss: ``coef * compute_approx_kl(..., type, old if unbiased)``."""

    coef: float  # --kl-loss-coef
    type: str = "low_var_kl"  # --kl-loss-type: k1 | k2 | k3 | low_var_kl
    unbiased: bool = False  # --use-unbiased-kl: importance-weight the estimate by pi / pi_old

    def __post_init__(self) -> None:
        _estimator(self.type)


def compute_approx_kl(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    kl_type: str,
    old_log_probs: Tensor | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref); same shape as the inputs, no reduction.

    `kl_type` is one of ``k1, k2, k3, low_var_kl`` (see the module docstring).

    If `old_log_probs` is given (``--use-unbiased-kl``), the estimate is multiplied by the importance weight
    ``exp(clamp(log_probs - old_log_probs, -20, 20))`` (clamped like the PPO ratio so it cannot overflow). Tokens are sampled from pi_old, not from the current pi, so this weight
    makes the estimator (and its gradient: the weight is NOT detached) unbiased for KL(pi_theta || pi_ref) when
    pi_theta has moved away from pi_old during the step. On the first micro-step the weight is exactly 1.
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs shape {tuple(log_probs.shape)} != ref_log_probs shape {tuple(ref_log_probs.shape)}"
        )
    kl = _estimator(kl_type)(log_probs.float() - ref_log_probs.float())
    if old_log_probs is not None:
        if old_log_probs.shape != log_probs.shape:
            raise ValueError(
                f"old_log_probs shape {tuple(old_log_probs.shape)} != log_probs shape {tuple(log_probs.shape)}"
            )
        log_w = (log_probs.float() - old_log_probs.float()).clamp(
            -_LOW_VAR_LOG_RATIO_CLAMP, _LOW_VAR_LOG_RATIO_CLAMP
        )
        kl = torch.exp(log_w) * kl
    return kl
