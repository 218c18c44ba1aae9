"""Pure RL math: advantages, policy losses, KL, mismatch corrections, reductions, the composed loss.

Nothing here imports ray, torch.distributed or the config namespace: every function maps tensors (per-sample
lists ``B x [L_i]``) and plain values to tensors, so a backend only packs data and runs collectives.
"""

from miles.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageOutputs,
    compute_advantages,
    discounted_returns,
    get_advantage_estimator,
    group_mean,
    group_std,
    load_custom_advantage,
    local_moments,
    masked_whiten,
    register_advantage,
)
from miles.algo.kl import KL_TYPES, compute_approx_kl
from miles.algo.logprobs import compute_entropy, compute_log_probs, log_probs_and_entropy
from miles.algo.loss import LossInputs, LossSettings, compute_loss, load_custom_loss
from miles.algo.metrics import (
    accumulate_metrics,
    finalize_metrics,
    masked_metric,
    metric,
    stack_metrics,
    unstack_metrics,
)
from miles.algo.mismatch import (
    MIS_LEVELS,
    compute_mis_mask,
    compute_mismatch_weights,
    compute_tis_weights,
    load_custom_tis_function,
)
from miles.algo.policy_loss import (
    POLICY_LOSSES,
    PolicyLossOutputs,
    compute_opsm_mask,
    compute_policy_loss,
    get_policy_loss,
    register_policy_loss,
)
from miles.algo.reductions import (
    REDUCTIONS,
    Reduction,
    reduce_loss,
    reduce_loss_and_metric,
    reduction_denominator,
    reduction_metric,
)
from miles.algo.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_TYPES",
    "MIS_LEVELS",
    "POLICY_LOSSES",
    "REDUCTIONS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageOutputs",
    "LossInputs",
    "LossSettings",
    "PolicyLossOutputs",
    "Reduction",
    "Registry",
    "accumulate_metrics",
    "compute_advantages",
    "compute_approx_kl",
    "compute_entropy",
    "compute_log_probs",
    "compute_loss",
    "compute_mis_mask",
    "compute_mismatch_weights",
    "compute_opsm_mask",
    "compute_policy_loss",
    "compute_tis_weights",
    "discounted_returns",
    "finalize_metrics",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_mean",
    "group_std",
    "load_custom_advantage",
    "load_custom_loss",
    "load_custom_tis_function",
    "log_probs_and_entropy",
    "local_moments",
    "masked_metric",
    "masked_whiten",
    "metric",
    "reduce_loss",
    "reduce_loss_and_metric",
    "reduction_denominator",
    "reduction_metric",
    "register_advantage",
    "register_policy_loss",
    "stack_metrics",
    "unstack_metrics",
]
