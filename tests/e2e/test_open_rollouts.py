"""Open rollouts end to end on CPU (Ray, embedded engines, FSDP2): DAPO dynamic sampling with eval before
training, and partial rollout with every prompt trained exactly once across rollouts."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("open_rollouts")
    model = build_tiny_model(root / "model", task="echo", seed=0)
    rows = make_rows("echo", 64, seed=0)
    for i, row in enumerate(rows):
        row["metadata"] = {"pid": i}
    data = write_jsonl(rows, root / "data.jsonl")
    evals = write_jsonl(make_rows("echo", 4, seed=1), root / "eval.jsonl")
    return root, str(model), str(data), str(evals)


def _argv(model: str, data: str, run_dir: str, extra: list[str]) -> list[str]:
    return [
        "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--custom-rm-path", "tests.integration.custom_fns:first_token_even",
        "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--global-batch-size", "16", "--lr", "5e-3", "--colocate", "--run-dir", run_dir,
        "--dump-details", os.path.join(run_dir, "dump"), *extra,
    ]  # fmt: skip


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _dump(run_dir: str, rollout_id: int) -> list[dict]:
    with open(os.path.join(run_dir, "dump", f"rollout_{rollout_id:07d}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_dapo_dynamic_sampling_with_eval_before_training(tiny):
    from miles.train import main

    root, model, data, evals = tiny
    run_dir = str(root / "dapo")
    extra = [
        "--dynamic-sampling-filter-path", "miles.rollout.filter_hub.check_reward_nonzero_std",
        "--over-sampling-batch-size", "6", "--rollout-max-response-len", "3",
        "--eval-prompt-data", "echo", evals, "--eval-interval", "2", "--n-samples-per-eval-prompt", "3",
        "--eval-top-p", "0.9",
    ]  # fmt: skip
    assert main(_argv(model, data, run_dir, extra)) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 0, 1, 2]
    before, steps = rows[0], rows[1:]
    assert {"eval/echo", "eval/echo/pass@1", "eval/echo/pass@3", "eval/echo/truncated_frac"} <= set(before)
    assert "train/loss" not in before and "eval/echo" in steps[1] and "eval/echo" not in steps[0]
    for r in steps:
        assert r["rollout/zero_std_group_frac"] == 0.0  # every trained group has a reward spread
        assert r["rollout/filtered_groups"] == sum(
            v for k, v in r.items() if k.startswith("rollout/filtered_groups/")
        )
        assert r["rollout/sampling_rounds"] >= 1
        assert r["train/first_mb_ppo_kl_abs_max"] == 0.0
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-5
    for rollout_id in range(3):
        samples = _dump(run_dir, rollout_id)
        assert len(samples) == 16
        by_group: dict[int, set[float]] = {}
        for s in samples:
            by_group.setdefault(s["group_index"], set()).add(s["reward"])
        assert len(by_group) == 4 and all(len(v) == 2 for v in by_group.values())


def test_partial_rollout_trains_every_prompt_once(tiny):
    from miles.train import main

    root, model, data, _ = tiny
    run_dir = str(root / "partial")
    extra = [
        "--partial-rollout", "--mask-offpolicy-in-partial-rollout", "--over-sampling-batch-size", "8",
        "--rollout-max-response-len", "6", "--engine-max-running-requests", "4",  # groups finish one by one
    ]  # fmt: skip
    assert main(_argv(model, data, run_dir, extra)) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    trained: Counter[int] = Counter()
    carried = 0
    for rollout_id, r in enumerate(rows):
        assert r["train/first_mb_ppo_kl_abs_max"] == 0.0
        # old segments are masked out, so the comparison covers tokens of the current weights only
        assert r["train/train_rollout_logprob_abs_diff"] <= 1e-5
        assert "rollout/buffered_groups" in r
        samples = _dump(run_dir, rollout_id)
        assert len(samples) == 16
        groups = {(s["group_index"], s["metadata"]["pid"]) for s in samples}
        assert len(groups) == 4
        trained.update(pid for _, pid in groups)
        for s in samples:
            versions, start, mask = s["weight_versions"], s["metadata"]["start_rollout_id"], s["loss_mask"]
            assert s["status"] in ("completed", "truncated")
            carried += start < rollout_id
            if len(versions) == 2:  # started by earlier weights, finished by these: only the new part trains
                assert versions == [str(start), str(rollout_id)] and mask[0] == 0 and mask[-1] == 1
            elif versions != [str(rollout_id)]:  # generated entirely by earlier weights: nothing trains
                assert versions == [str(start)] and start < rollout_id and set(mask) == {0}
            else:  # generated entirely by the current weights (possibly after waiting in the buffer)
                assert set(mask) == {1}
        assert r["rollout/carried_over_samples"] == sum(
            s["metadata"]["start_rollout_id"] < rollout_id for s in samples
        )
    assert carried > 0  # some groups were cut short and finished a rollout later
    assert all(n == 1 for n in trained.values())  # no prompt trained twice
