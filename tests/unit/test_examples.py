"""The shipped example reward function loads by path and scores through the reward hub."""

from __future__ import annotations

import asyncio

from miles.rollout.rm_hub import RewardContext, RewardScorer
from miles.utils.types import Sample


def test_custom_reward_example_scores_samples():
    scorer = RewardScorer(RewardContext(max_response_len=4), "examples.custom_reward:length_penalized_math")
    samples = [
        Sample(index=0, response="the answer is \\boxed{3}", response_length=2, label="3"),
        Sample(index=1, response="7", response_length=4, label="3"),
    ]
    assert asyncio.run(scorer.score(samples)) == 0
    assert [s.reward for s in samples] == [1.0, -0.1]
