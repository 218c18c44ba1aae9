"""The shipped example reward function loads by path and scores through the reward hub."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from miles.rollout.rm_hub import score_samples
from miles.utils.types import Sample


def test_custom_reward_example_scores_samples():
    args = SimpleNamespace(rollout=SimpleNamespace(rollout_max_response_len=4))
    samples = [
        Sample(index=0, response="the answer is \\boxed{3}", response_length=2, label="3"),
        Sample(index=1, response="7", response_length=4, label="3"),
    ]
    scores, failed = asyncio.run(
        score_samples(samples, None, "examples.custom_reward:length_penalized_math", args, error_as_zero=False)
    )
    assert scores == [1.0, -0.1] and failed == 0
