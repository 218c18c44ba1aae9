"""When the trainer may read the old log-probs off the training forward (rb.old_log_probs_from_training_forward)."""

from __future__ import annotations

import pytest

from miles.backends.fsdp_utils.rollout_batch import old_log_probs_from_training_forward
from miles.config import parse_config

BASE = ["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--num-rollout", "1", "--colocate"]  # fmt: skip


@pytest.mark.parametrize(
    "extra, steps, has_ref, expected",
    [
        ([], 1, False, True),
        ([], 2, False, False),  # the weights move between optimizer steps
        (["--use-kl-loss", "--kl-loss-coef", "0.1", "--use-tis"], 1, True, True),  # loss-side uses only
        (
            ["--kl-coef", "0.1", "--advantage-estimator", "reinforce_plus_plus"],
            1,
            True,
            False,
        ),  # KL-in-reward reads them before training
        (
            ["--kl-coef", "0.1", "--advantage-estimator", "reinforce_plus_plus"],
            1,
            False,
            True,
        ),  # no reference model: the penalty is off
        (["--custom-advantage-function-path", "x.y:z"], 1, False, False),  # receives them
    ],
)
def test_reuse_condition(extra, steps, has_ref, expected):
    cfg = parse_config(BASE + extra)
    assert old_log_probs_from_training_forward(steps, cfg, has_ref) is expected
