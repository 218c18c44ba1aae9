"""Built-in reward types: "math", "deepscaler" and "exact_match". All return 1.0 or 0.0."""

from __future__ import annotations

from typing import Any

from miles.rollout.rm_hub.math_utils import math_reward
from miles.rollout.rm_hub.registry import register_reward
from miles.utils.types import Sample

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@register_reward("math")
def math_rm(args: Any, sample: Sample) -> float:
    """Final answer of the response (boxed, "answer is", or last number) equals the label."""
    return math_reward(sample.response, sample.label)


@register_reward("deepscaler")
def deepscaler_rm(args: Any, sample: Sample) -> float:
    """As "math", scored only on the text after the last `</think>`; 0.0 when `<think>` is never closed."""
    response = sample.response
    if THINK_CLOSE in response:
        response = response.rsplit(THINK_CLOSE, 1)[1]
    elif THINK_OPEN in response:
        return 0.0
    return math_reward(response, sample.label)


@register_reward("exact_match")
def exact_match_rm(args: Any, sample: Sample) -> float:
    """The stripped response equals the stripped label (as a string)."""
    if sample.label is None:
        raise ValueError("exact_match reward needs a label; got None (check --label-key)")
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0
