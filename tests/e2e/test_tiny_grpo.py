"""End to end on CPU: Ray driver, embedded engines behind sglang-router, FSDP2 trainers, colocated refit."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("tiny")
    model = build_tiny_model(root / "model", task="echo", seed=0)
    data = write_jsonl(make_rows("echo", 256, seed=0), root / "data.jsonl")
    return root, str(model), str(data)


def _args(model: str, data: str, run_dir: str, num_rollout: int, extra: list[str] = ()) -> list[str]:
    return [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        str(data),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--rollout-shuffle",
        "--rm-type",
        "math",
        "--num-rollout",
        str(num_rollout),
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "4",
        "--rollout-temperature",
        "1.0",
        "--global-batch-size",
        "16",
        "--lr",
        "1e-3",
        "--actor-num-gpus-per-node",
        "2",
        "--colocate",
        "--run-dir",
        run_dir,
        "--save",
        os.path.join(run_dir, "ckpt"),
        "--save-interval",
        "2",
        "--update-weight-buffer-size",
        "20000",  # several buckets even for the tiny model
        *extra,
    ]


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_colocated_grpo_steps_and_resume(tiny):
    from miles.train import main

    root, model, data = tiny
    run_dir = str(root / "run")
    hf = os.path.join(run_dir, "hf")
    assert main(_args(model, data, run_dir, num_rollout=3, extra=["--save-hf", hf, "--use-tensorboard"])) == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # what a user watches and takes away: the report, tensorboard events, the HF export of every save
    assert os.path.getsize(os.path.join(run_dir, "report.png")) > 10_000
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run_dir, "tensorboard")))
    assert sorted(os.listdir(hf)) == ["iter_0000001", "iter_0000002"]  # --save-hf follows --save-interval
    for key in (
        "perf/generated_tokens_per_s",
        "perf/trained_tokens_per_s",
        "perf/samples_per_s",
        "perf/train_peak_rss_gb",
        "perf/driver_peak_rss_gb",
    ):
        assert all(r[key] > 0 for r in rows), key
    for r in rows:
        for key in (
            "rollout/raw_reward",
            "train/loss",
            "train/pg_loss",
            "train/pg_clipfrac",
            "train/ppo_kl",
            "train/grad_norm",
            "train/train_rollout_logprob_abs_diff",
            "timing/rollout",
            "timing/train",
            "timing/refit",
            "rollout/dropped_prompts",
        ):
            assert key in r, key
        assert r["rollout/dropped_prompts"] == 0.0  # no --rollout-max-prompt-len
        assert 0.0 <= r["rollout/raw_reward"] <= 1.0
        # old log-probs are recomputed with the rollout's weights: the first micro-batch is exactly on-policy
        assert r["train/first_mb_ppo_kl_abs_max"] == 0.0
        # after every refit the engine runs the trainer's weights (fp32 on both sides)
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-5
        if r["rollout/zero_std_group_frac"] < 1.0:  # some group has a reward spread: a real gradient
            assert r["train/grad_norm"] > 0.0
        else:  # every advantage is 0
            assert r["train/grad_norm"] == 0.0
    ckpt = os.path.join(run_dir, "ckpt")
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"  # saved at rollout 1 (interval 2) and at the last one

    # resume as after a crash that lost checkpoint 2: from checkpoint 1, rollouts 2 and 3 run (again); the
    # metrics keep each step once
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1\n")
    straight = rows
    assert main(_args(model, data, run_dir, num_rollout=4, extra=["--load", ckpt])) == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # the resumed run continues the same trajectory: rollout 2 again draws the same samples (data cursor from
    # the checkpoint, a sampling_seed per request whichever engine or batch serves it)
    for key in ("rollout/raw_reward", "rollout/response_len"):
        assert rows[2][key] == straight[2][key], key
    assert rows[3]["train/train_rollout_logprob_abs_diff"] <= 1e-5
