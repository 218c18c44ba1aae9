"""The tool-use example as shipped (examples/calculator/run.sh): the tiny model learns to call the calculator and
use its answer, through multi-turn rollouts whose tool tokens are never trained on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 30


def test_calculator_example_learns_to_use_the_tool(tmp_path):
    env = {**os.environ, "MILES_CALC_DIR": str(tmp_path / "calc"), "RUN_DIR": str(tmp_path / "run"),
           "NUM_ROLLOUT": str(NUM_ROLLOUT)}  # fmt: skip
    proc = subprocess.run(
        ["bash", "examples/calculator/run.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == NUM_ROLLOUT

    def early_late(key: str) -> tuple[float, float]:
        values = [r[key] for r in rows]
        return sum(values[:3]) / 3, sum(values[-3:]) / 3

    first, last = early_late("rollout/raw_reward")
    assert last - first >= 0.3, [r["rollout/raw_reward"] for r in rows]
    calls_first, calls_last = early_late("rollout/tool_calls")
    assert calls_last > calls_first + 0.3, [r["rollout/tool_calls"] for r in rows]
    assert all(r["train/first_mb_ppo_kl_abs_max"] == 0.0 for r in rows)
    # model tokens only (tool tokens are masked): the trainer's packed log-probs equal the engine's
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in rows) <= 1e-5
