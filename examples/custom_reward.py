"""A custom reward function, as passed with `--custom-rm-path examples.custom_reward:length_penalized_math`.

A reward function is called as `fn(ctx, sample)` (sync or async) with a `RewardContext` (the settings a
reward may need, such as `max_response_len`) and one `miles.utils.types.Sample` (prompt, response text, token
ids, label, metadata), and returns a float (or a dict of floats; `--reward-key` picks the trained one).
"""

from __future__ import annotations

from miles.rollout.rm_hub import RewardContext
from miles.rollout.rm_hub.math_utils import math_reward
from miles.utils.types import Sample


def length_penalized_math(ctx: RewardContext, sample: Sample) -> float:
    """The math answer check, minus a small penalty for using the whole response budget."""
    correct = math_reward(sample.response, sample.label)
    return correct - 0.1 * (sample.response_length >= ctx.max_response_len)
