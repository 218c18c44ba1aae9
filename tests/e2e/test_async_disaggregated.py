"""One-step-off async training with disaggregated placement, context parallelism and dynamic batching."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow


def test_async_disaggregated_cp2_dynamic(tmp_path):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl
    from miles.train_async import main

    model = build_tiny_model(tmp_path / "model", task="echo", seed=0)
    data = write_jsonl(make_rows("echo", 64, seed=0), tmp_path / "data.jsonl")
    run_dir = str(tmp_path / "run")
    argv = [
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
        "--custom-rm-path", "tests.integration.custom_fns:first_token_even", "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "3", "--global-batch-size", "16", "--lr", "5e-3",
        "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2", "--rollout-num-gpus", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "40", "--run-dir", run_dir,
    ]  # fmt: skip
    assert main(argv) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/first_mb_ppo_kl_abs_max"] == 0.0 for r in rows)
    # rollout 0 came from the initial weights, which trained on it: on-policy
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5
    # rollout 1 was generated while the trainer stepped on rollout 0: one policy version behind (the reward
    # gives every group a spread, so that step moves the weights)
    assert rows[0]["train/grad_norm"] > 0.0
    assert rows[1]["train/train_rollout_logprob_abs_diff"] > 1e-5


def test_async_driver_refuses_colocate(capsys):
    from miles.train_async import main

    argv = [
        "--hf-checkpoint",
        "/m",
        "--prompt-data",
        "/d.jsonl",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--colocate",
    ]
    assert main(argv) == 2
    assert "--colocate" in capsys.readouterr().err
