"""Reward hub: registered reward types (`--rm-type`), custom reward functions, remote rewards and scoring."""

from miles.rollout.rm_hub import builtin as _builtin  # noqa: F401 - registers the built-in reward types
from miles.rollout.rm_hub.context import RewardContext
from miles.rollout.rm_hub.registry import get_reward_fn, load_custom_rm, register_reward, reward_types
from miles.rollout.rm_hub.scoring import RewardScorer, builtin_reward, check_reward, score_samples

__all__ = [
    "RewardContext",
    "RewardScorer",
    "builtin_reward",
    "check_reward",
    "get_reward_fn",
    "load_custom_rm",
    "register_reward",
    "reward_types",
    "score_samples",
]
