"""Each advantage estimator through the whole system for a couple of rollouts (1 trainer, 1 engine, colocated),
plus eval, wandb (offline) and detail dumps on the way."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow

ESTIMATORS = {
    "grpo": ["--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl", "--use-tis"],
    "gspo": ["--eps-clip", "3e-4", "--eps-clip-high", "4e-4"],
    "reinforce_plus_plus": ["--kl-coef", "0.01", "--gamma", "0.95"],
    "reinforce_plus_plus_baseline": ["--normalize-advantages"],
    "rloo": ["--use-mis", "--entropy-coef", "0.001"],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("estimators")
    model = build_tiny_model(root / "model", task="echo", seed=0)
    data = write_jsonl(make_rows("echo", 64, seed=0), root / "data.jsonl")
    evals = write_jsonl(make_rows("echo", 8, seed=1), root / "eval.jsonl")
    return root, str(model), str(data), str(evals)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_estimator_end_to_end(tiny, estimator):
    from miles.train import main

    root, model, data, evals = tiny
    run_dir = str(root / estimator)
    argv = [
        "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "2", "--global-batch-size", "8", "--lr", "5e-3", "--colocate",
        "--advantage-estimator", estimator, "--run-dir", run_dir,
        "--eval-prompt-data", "echo", evals, "--eval-interval", "2", "--n-samples-per-eval-prompt", "2",
        "--skip-eval-before-train",
        "--dump-details", os.path.join(run_dir, "dump"),
        *ESTIMATORS[estimator],
    ]  # fmt: skip
    if estimator == "grpo":
        argv += ["--use-wandb", "--wandb-project", "miles-test", "--wandb-mode", "offline"]
    assert main(argv) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["train/first_mb_ppo_kl_abs_max"] == 0.0
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-5
        assert "train/pg_loss" in r and "train/ois" in r
    assert 0.0 <= rows[1]["eval/echo"] <= 1.0 and "eval/echo" not in rows[0]
    assert os.path.exists(os.path.join(run_dir, "dump", "rollout_0000001.jsonl"))
    if estimator == "grpo":
        assert "train/kl_loss" in rows[0] and "train/tis" in rows[0]
        assert os.path.isdir(os.path.join(run_dir, "wandb"))
    if estimator == "rloo":
        assert "train/mis_masked_frac" in rows[0] and "train/entropy_loss" in rows[0]
