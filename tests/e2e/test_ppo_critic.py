"""--advantage-estimator ppo through the whole system (colocated: actor, critic and engine share the bundle; only one
of actor/critic is awake at a time): it learns the tiny echo task, and it resumes actor + critic from a checkpoint."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("ppo")
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
        "--advantage-estimator", "ppo", "--critic-lr", "5e-3", "--optimizer", "adam", "--lr", "5e-3",
        "--actor-num-gpus-per-node", "1", "--colocate", "--update-weight-buffer-size", "1048576",
        "--run-dir", run_dir, "--seed", "1", *extra,
    ]  # fmt: skip


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_ppo_with_critic_learns_the_tiny_task(tiny):
    from miles.train import main

    root, model, data = tiny
    run_dir = str(root / "learn")
    assert main(_argv(model, data, run_dir, 20, [])) == 0
    rows = _rows(run_dir)
    rewards = [r["rollout/raw_reward"] for r in rows]
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.3, rewards
    for r in rows:
        assert r["train/first_mb_ppo_kl_abs_max"] == 0.0
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-5
        for key in (
            "critic/value_loss",
            "critic/value_clipfrac",
            "critic/explained_variance",
            "critic/grad_norm",
        ):
            assert key in r, key
    assert rows[-1]["critic/value_loss"] > 0.0


def test_ppo_resumes_actor_and_critic(tiny):
    from miles.train import main

    root, model, data = tiny
    run_dir = str(root / "resume")
    ckpt = os.path.join(run_dir, "ckpt")
    critic_only = ["--num-critic-only-steps", "1"]
    assert (
        main(_argv(model, data, run_dir, 2, ["--save", ckpt, "--save-interval", "1", *critic_only], 4)) == 0
    )
    first = _rows(run_dir)
    assert (
        "train/loss" not in first[0] and "critic/value_loss" in first[0]
    )  # rollout 0 trains the critic only
    assert "train/loss" in first[1]
    assert open(os.path.join(ckpt, "critic", "latest_checkpointed_iteration.txt")).read().strip() == "1"
    assert main(_argv(model, data, run_dir, 3, ["--load", ckpt, "--save", ckpt, *critic_only], 4)) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "critic/value_loss" in rows[2] and "train/loss" in rows[2]
