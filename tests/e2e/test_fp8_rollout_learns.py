"""FP8 rollout from fp32 training on CPU (scripts/run-tiny-cpu.sh with --rollout-weight-quantization fp8): the
engines serve block-FP8 linear weights (dequantized on load), TIS and MIS correct the rollout/train mismatch, the
refit checksums agree, and the tiny model still learns the toy task."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_fp8_rollout_run_learns_with_tis_and_mis(tmp_path):
    env = {
        **os.environ,
        "MILES_SKIP_INSTALL": "1",
        "MILES_TINY_DIR": str(tmp_path / "tiny"),
        "RUN_DIR": str(tmp_path / "run"),
        "NUM_ROLLOUT": "30",
    }
    extra = [
        "--rollout-weight-quantization", "fp8", "--check-weight-update-equal",
        "--use-tis", "--use-mis", "--mis-lower", "0.1", "--mis-upper", "10", "--save-interval", "100",
    ]  # fmt: skip
    proc = subprocess.run(
        ["bash", "scripts/run-tiny-cpu.sh", *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 30
    rewards = [r["rollout/raw_reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first >= 0.3, rewards
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    # FP8 weights give the engine other log-probs than the fp32 trainer (an fp32 rollout's gap is <= 1e-5), and
    # TIS weighs them: the correction is active
    assert min(gaps) > 1e-4, gaps
    assert all("train/tis" in r for r in rows)
