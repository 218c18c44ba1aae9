"""Reward hub: registered reward types (`--rm-type`), custom reward functions and batch scoring."""

from miles.rollout.rm_hub import builtin as _builtin  # noqa: F401 - registers the built-in reward types
from miles.rollout.rm_hub.registry import get_reward_fn, load_custom_rm, register_reward, reward_types
from miles.rollout.rm_hub.scoring import resolve_reward_fn, score_samples

__all__ = [
    "get_reward_fn",
    "load_custom_rm",
    "register_reward",
    "resolve_reward_fn",
    "reward_types",
    "score_samples",
]
