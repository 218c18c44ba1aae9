"""Names of the built-in algorithm variants, for the command line (torch-free: the config must not import torch).

The registries in `miles.algo` are the source of truth; tests/unit/test_algo_registry.py checks these tuples
against them, so a variant registered in `miles.algo` without being listed here fails a test rather than being
unselectable from the CLI.
"""

from __future__ import annotations

ADVANTAGE_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "gspo",
    "ppo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
)
POLICY_LOSSES: tuple[str, ...] = ("gspo", "ppo")
LOSS_REDUCTIONS: tuple[str, ...] = ("constant_sum", "sample_mean", "token_mean")
KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
MIS_LEVELS: tuple[str, ...] = ("sequence", "token")


def default_policy_loss(advantage_estimator: str) -> str:
    """The policy loss an estimator implies when --policy-loss is not given: GSPO's sequence-level ratio for
    `gspo`, the PPO clip loss for every other estimator."""
    return "gspo" if advantage_estimator == "gspo" else "ppo"
