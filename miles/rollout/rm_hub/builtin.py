"""Built-in reward types (`--rm-type`, or a sample's `metadata["rm_type"]`).

  math         final answer (boxed, "answer is", last number) equals the label: 1.0 / 0.0
  deepscaler   as math, on the text after the last `</think>`; 0.0 when `<think>` is never closed
  exact_match  stripped response equals the stripped label: 1.0 / 0.0
  dapo         DAPO's "Answer: X" check: {"score": 1.0 / -1.0, "acc": 1.0 / 0.0} (use --reward-key score)
  f1           SQuAD token F1 against the label (or the best of a list of labels), in [0, 1]
  gpqa         multiple-choice letter (label: letter, index, or choice text with metadata["choices"])
  remote_rm    POST to the reward service at --rm-url (see miles.rollout.rm_hub.remote)

Any type may be prefixed with `boxed_` (e.g. `boxed_f1`): the response is replaced by the content of its last
`\\boxed{...}` (empty when there is none) before scoring.
"""

from __future__ import annotations

from miles.rollout.rm_hub.context import RewardContext
from miles.rollout.rm_hub.math_utils import math_reward
from miles.rollout.rm_hub.registry import Reward, register_reward
from miles.rollout.rm_hub.remote import remote_reward
from miles.rollout.rm_hub.text_rewards import dapo_score, f1_score, gpqa_score
from miles.utils.types import Sample

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@register_reward("math")
def math_rm(ctx: RewardContext, sample: Sample) -> float:
    """Final answer of the response (boxed, "answer is", or last number) equals the label."""
    return math_reward(sample.response, sample.label)


@register_reward("deepscaler")
def deepscaler_rm(ctx: RewardContext, sample: Sample) -> float:
    """As "math", scored only on the text after the last `</think>`; 0.0 when `<think>` is never closed."""
    response = sample.response
    if THINK_CLOSE in response:
        response = response.rsplit(THINK_CLOSE, 1)[1]
    elif THINK_OPEN in response:
        return 0.0
    return math_reward(response, sample.label)


@register_reward("exact_match")
def exact_match_rm(ctx: RewardContext, sample: Sample) -> float:
    """The stripped response equals the stripped label (as a string)."""
    if sample.label is None:
        raise ValueError("exact_match reward needs a label; got None (check --label-key)")
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0


@register_reward("dapo")
def dapo_rm(ctx: RewardContext, sample: Sample) -> dict[str, float]:
    """DAPO's "Answer: X" check: {"score": +1 / -1, "acc": 1 / 0}."""
    return dapo_score(sample.response, sample.label)


@register_reward("f1")
def f1_rm(ctx: RewardContext, sample: Sample) -> float:
    """SQuAD token F1 between response and label."""
    return f1_score(sample.response, sample.label)


@register_reward("gpqa")
def gpqa_rm(ctx: RewardContext, sample: Sample) -> float:
    """Multiple-choice letter against the label (metadata may carry "choices" / "valid_letters")."""
    return gpqa_score(sample.response, sample.label, sample.metadata)


@register_reward("remote_rm")
async def remote_rm(ctx: RewardContext, sample: Sample) -> Reward:
    """The reward service at --rm-url, called with retries and a deadline per attempt."""
    return await remote_reward(ctx, sample)
