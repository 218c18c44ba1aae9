"""--fully-async (issue 25): a persistent generation worker, refits under paused requests (abort, in_place,
retract), every trained sample within --max-weight-staleness, reward up; with bound 0 and interval 1 the
synchronous driver's run."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow


def _argv(tmp_path, run: str, *extra: str) -> list[str]:
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    model, data = tmp_path / "model", tmp_path / "data.jsonl"
    if not (model / "config.json").exists():
        build_tiny_model(model, task="echo", seed=0)
        write_jsonl(make_rows("echo", 256, seed=0), data)
    run_dir = str(tmp_path / run)
    return [
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
        "--custom-rm-path", "tests.integration.custom_fns:first_token_even", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3", "--global-batch-size", "16",
        "--lr", "2e-2", "--seed", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--run-dir", run_dir, "--dump-details", os.path.join(run_dir, "dump"), *extra,
    ]  # fmt: skip


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _trained_samples(run_dir) -> list[dict]:
    dump = os.path.join(run_dir, "dump")
    out = []
    for name in sorted(os.listdir(dump)):
        if name.startswith("rollout_"):
            with open(os.path.join(dump, name)) as f:
                out += [json.loads(line) for line in f]
    return out


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_fully_async_learns_within_the_staleness_bound(tmp_path, mode):
    from miles.train_async import main

    # 16 steps: with 12, one CI run's first-3 vs last-3 gain was 0.27 (which groups finish first varies by timing)
    steps, bound = 16, 1
    argv = _argv(
        tmp_path, mode, "--num-rollout", str(steps), "--fully-async", "--max-weight-staleness", str(bound),
        "--pause-generation-mode", mode, "--async-max-concurrent-samples", "32",
    )  # fmt: skip
    assert main(argv) == 0
    rows = _rows(tmp_path / mode)
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["async/staleness_max"] <= bound for r in rows)
    samples = _trained_samples(tmp_path / mode)
    assert len(samples) == steps * 16
    assert all(0 <= s["metadata"]["weight_staleness"] <= bound for s in samples)
    # generation overlapped training: some trained samples came from the weights before the last refit
    assert any(s["metadata"]["weight_staleness"] == 1 for s in samples)
    rewards = [r["rollout/raw_reward"] for r in rows]
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.3, rewards


def test_bound_zero_interval_one_equals_the_synchronous_driver(tmp_path):
    """Same prompts, same request ids (so the same sampling seeds), same batching: the same samples and metrics."""
    from miles.train import main as sync_main
    from miles.train_async import main as async_main

    steps = ["--num-rollout", "3"]
    assert sync_main(_argv(tmp_path, "sync", *steps)) == 0
    argv = _argv(tmp_path, "async0", *steps, "--fully-async", "--max-weight-staleness", "0",
                 "--pause-generation-mode", "abort")  # fmt: skip
    assert async_main(argv) == 0
    sync, full = _trained_samples(tmp_path / "sync"), _trained_samples(tmp_path / "async0")
    assert [s["tokens"] for s in full] == [s["tokens"] for s in sync]
    assert [s["rollout_log_probs"] for s in full] == [s["rollout_log_probs"] for s in sync]
    assert all(s["metadata"]["weight_staleness"] == 0 for s in full)
    for a, b in zip(_rows(tmp_path / "sync"), _rows(tmp_path / "async0"), strict=True):
        for key in (
            "rollout/raw_reward",
            "train/loss",
            "train/grad_norm",
            "train/train_rollout_logprob_abs_diff",
        ):
            assert a[key] == b[key], (key, a[key], b[key])
