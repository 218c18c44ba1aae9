"""Built-in reward types (`--rm-type`, or a sample's `metadata["rm_type"]`).

  math         final answer (boxed, "answer is", last number) equals the label: 1.0 / 0.0
  deepscaler   the `\\boxed{}` answer of the final part (after the last `</think>`, else after `###Response`)
               equals the label; 0.0 without either marker or without a boxed answer (the reference's rule)
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
from miles.rollout.rm_hub.math_utils import answer_reward, last_boxed_content, math_reward
from miles.rollout.rm_hub.registry import Reward, register_reward
from miles.rollout.rm_hub.remote import remote_reward
from miles.rollout.rm_hub.text_rewards import dapo_score, f1_score, gpqa_score
from miles.utils.types import Sample

THINK_CLOSE = "</think>"
RESPONSE_MARKER = "###Response"


@register_reward("math")
def math_rm(ctx: RewardContext, sample: Sample) -> float:
    """Final answer of the response (boxed, "answer is", or last number) equals the label."""
    return math_reward(sample.response, sample.label)


@register_reward("deepscaler")
def deepscaler_rm(ctx: RewardContext, sample: Sample) -> float:
    """The reference's DeepScaleR rule: only the final part of the response is scored, and only its boxed answer.

    The final part is the text after the last `</think>`, else the text after the first `###Response` (up to
    a second one, if any); a response with neither marker scores 0.0, as does a final part without a
    `\\boxed{}` answer. The boxed answer is compared with the label as `math` compares answers.
    """
    final = deepscaler_final_part(sample.response)
    return answer_reward(None if final is None else last_boxed_content(final), sample.label)


def deepscaler_final_part(response: str) -> str | None:
    """The part of `response` the deepscaler reward scores, or None when it has no `</think>` / `###Response`."""
    if THINK_CLOSE in response:
        return response.rsplit(THINK_CLOSE, 1)[1]
    if RESPONSE_MARKER in response:
        return response.split(RESPONSE_MARKER)[1]
    return None


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
