"""The shipped launch scripts validate under --dry-run, and the CLI answers --help fast without heavy imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_qwen3_4b_script_passes_dry_run():
    proc = subprocess.run(
        ["bash", "scripts/run-qwen3-4B-fsdp.sh", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["train"]["train_backend"] == "fsdp"
    assert cfg["cluster"]["colocate"] is True and cfg["cluster"]["actor_num_gpus_per_node"] == 8
    assert cfg["engine"]["sglang_args"]["mem_fraction_static"] == "0.7"
    assert cfg["algo"]["eps_clip_high"] == 0.28


def test_help_imports_nothing_heavy():
    """--help must stay fast: it answers before torch, ray or transformers are imported."""
    code = (
        "import sys, time; t = time.perf_counter(); from miles.train import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "--rollout-batch-size" in proc.stdout and "HEAVY []" in proc.stdout


def test_bad_flags_exit_2_with_every_violation(capsys):
    from miles.train import main

    assert main(["--hf-checkpoint", "/m", "--num-rollout", "0", "--lr", "-1", "--no-such-flag", "3"]) == 2
    err = capsys.readouterr().err
    for fragment in ("--num-rollout", "--lr", "--no-such-flag", "--prompt-data"):
        assert fragment in err, fragment
