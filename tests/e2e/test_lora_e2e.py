"""--lora-rank through the whole system (colocated, embedded engine): refits send merged weights that the engine
holds bit-equal to the trainer's (--check-weight-update-equal compares per-tensor checksums after every refit, in
fp32), the engine's log-probs equal the adapted trainer's, and the run resumes from its checkpoint."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("lora")
    model = build_tiny_model(root / "model", task="echo", seed=0)
    data = write_jsonl(make_rows("echo", 2000, seed=0), root / "echo.jsonl")
    return root, str(model), str(data)


def _argv(
    model: str, data: str, run_dir: str, num_rollout: int, extra: list[str], prompts: int = 16
) -> list[str]:
    return [
        "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math",
        "--num-rollout", str(num_rollout), "--rollout-batch-size", str(prompts), "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "2", "--global-batch-size", str(8 * prompts), "--micro-batch-size", "32",
        "--lora-rank", "8", "--lora-alpha", "16", "--lora-target-modules", "all-linear",
        "--optimizer", "adam", "--lr", "2e-2", "--check-weight-update-equal",
        "--actor-num-gpus-per-node", "1", "--colocate", "--update-weight-buffer-size", "1048576",
        "--run-dir", run_dir, "--seed", "1", *extra,
    ]  # fmt: skip


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_lora_run_refits_merged_weights_exactly(tiny):
    from miles.train import main

    root, model, data = tiny
    run_dir = str(root / "refits")
    assert main(_argv(model, data, run_dir, 4, ["--use-kl-loss", "--kl-loss-coef", "0.001"], 8)) == 0
    rows = _rows(run_dir)
    assert rows[0]["train/kl_loss"] == 0.0  # the reference is the base, and the adapters start at B = 0
    assert rows[-1]["train/kl_loss"] > 0.0  # the adapters moved the policy; the reference stayed the base
    for r in rows:
        assert r["train/first_mb_ppo_kl_abs_max"] == 0.0
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-5  # the engine samples from the merged weights


def test_lora_resumes(tiny):
    from miles.train import main

    root, model, data = tiny
    run_dir = str(root / "resume")
    ckpt = os.path.join(run_dir, "ckpt")
    assert main(_argv(model, data, run_dir, 2, ["--save", ckpt, "--save-interval", "1"], 4)) == 0
    assert main(_argv(model, data, run_dir, 3, ["--load", ckpt], 4)) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["train/train_rollout_logprob_abs_diff"] <= 1e-5  # resumed adapters, refit merged
