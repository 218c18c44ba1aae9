"""The README's main job, as shipped (scripts/run-tiny-cpu.sh): it must learn, not just run."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_tiny_cpu_run_learns_the_toy_task(tmp_path):
    env = {
        **os.environ,
        "MILES_SKIP_INSTALL": "1",
        "MILES_TINY_DIR": str(tmp_path / "tiny"),
        "RUN_DIR": str(tmp_path / "run"),
    }
    proc = subprocess.run(
        ["bash", "scripts/run-tiny-cpu.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert sum(line.startswith("rollout ") for line in proc.stdout.splitlines()) == 60
    # a console a person can read: no library's INFO line (httpx logged every engine call), in any process
    # (Ray forwards its actors' output to this console)
    console = proc.stdout + proc.stderr
    chatter = [
        line for line in console.splitlines()
        if (m := re.search(r"\b(?:INFO|DEBUG)\s+\[?([\w.]+)", line)) and m.group(1).split(".")[0] not in ("miles", "__main__")
    ]  # fmt: skip
    assert "HTTP Request:" not in console and not chatter, chatter[:5]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    # the first rollouts equal the golden metrics (tests/e2e/golden: how to check a run by hand, how to update)
    from tests.e2e.golden import differences, read_rows

    golden_diff = differences(read_rows(tmp_path / "run" / "metrics.jsonl"))
    assert not golden_diff, golden_diff
    rewards = [r["rollout/raw_reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first >= 0.3, rewards
    assert all(r["train/first_mb_ppo_kl_abs_max"] == 0.0 for r in rows)
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in rows) <= 1e-5
    assert (tmp_path / "run" / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "59"
    assert (tmp_path / "run" / "report.png").stat().st_size > 10_000

    # the trained model leaves the run as a HF directory that transformers loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.tools.convert_to_hf import main as convert

    out = tmp_path / "hf"
    assert convert(["--checkpoint", str(tmp_path / "run" / "ckpt"), "--out", str(out)]) == 0
    AutoTokenizer.from_pretrained(out)
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny" / "model").state_dict()
    assert any(not (trained[k] == initial[k]).all() for k in initial)
