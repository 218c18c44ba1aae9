"""A custom reward function, as passed with `--custom-rm-path examples.custom_reward:length_penalized_math`.

A reward function is called as `fn(args, sample)` (sync or async) with the run's Config and one
`miles.utils.types.Sample` (prompt, response text, token ids, label, metadata), and returns a float.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.rm_hub.math_utils import math_reward
from miles.utils.types import Sample


def length_penalized_math(args: Any, sample: Sample) -> float:
    """The math answer check, minus a small penalty for using the whole response budget."""
    correct = math_reward(sample.response, sample.label)
    budget = args.rollout.rollout_max_response_len
    return correct - 0.1 * (sample.response_length >= budget)
