"""Replay debugging end to end: a live run saves its rollouts; a replay trains on them with no engines and logs
bit-equal training metrics; a rollout-only run generates and logs without a trainer."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("replay")
    model = build_tiny_model(root / "model", task="echo", seed=0)
    data = write_jsonl(make_rows("echo", 64, seed=0), root / "data.jsonl")
    return root, str(model), str(data)


def _args(model: str, data: str, run_dir: str, extra: list[str]) -> list[str]:
    return [
        "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
        "--global-batch-size", "8", "--lr", "1e-2", "--actor-num-gpus-per-node", "2", "--colocate",
        "--run-dir", run_dir, "--seed", "3", "--no-progress", *extra,
    ]  # fmt: skip


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _numbers(row: dict) -> dict:
    """Everything but wall time and process memory."""
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))}


def test_replayed_rollouts_train_bit_equal_and_rollout_only_runs(tiny):
    from miles.train import main

    root, model, data = tiny
    saved = str(root / "dbg" / "rollout_{rollout_id}.jsonl")
    live, replay, gen_only = (str(root / name) for name in ("live", "replay", "gen_only"))

    assert main(_args(model, data, live, ["--save-debug-rollout-data", saved])) == 0
    assert sorted(os.listdir(root / "dbg")) == ["rollout_0.jsonl", "rollout_1.jsonl"]  # no .tmp left

    # two optimizer steps per rollout: the second trains on weights the first changed, so equal grad norms
    # there mean the replayed update is the live one
    replay_args = ["--load-debug-rollout-data", saved, "--debug-train-only"]
    assert main(_args(model, data, replay, replay_args)) == 0
    rows_live, rows_replay = _metrics(live), _metrics(replay)
    assert [r["step"] for r in rows_replay] == [0, 1]
    for a, b in zip(rows_live, rows_replay):
        assert _numbers(a) == _numbers(b)  # loss, grad norm, kl, rewards: bit for bit
        assert a["train/grad_norm"] > 0 or a["rollout/zero_std_group_frac"] == 1.0

    assert main(_args(model, data, gen_only, ["--debug-rollout-only"])) == 0
    rows = _metrics(gen_only)
    assert [r["step"] for r in rows] == [0, 1]
    assert all("rollout/raw_reward" in r and not any(k.startswith("train/") for k in r) for r in rows)
