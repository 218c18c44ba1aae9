"""The shipped launch scripts validate under --dry-run, and the CLI answers --help fast without heavy imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_qwen3_4b_script_passes_dry_run(tmp_path):
    # The flags validate; the pre-flight checks of --dry-run then refuse only what this machine lacks: the
    # model and the data files the script expects under /root.
    proc = subprocess.run(
        ["bash", "scripts/run-qwen3-4B-fsdp.sh", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if Path("/root/Qwen3-4B").is_dir():
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2 and "pre-flight check failed" in proc.stderr, proc.stderr
        assert "invalid configuration" not in proc.stderr
        for path in (
            "/root/Qwen3-4B",
            "/root/dapo-math-17k/dapo-math-17k.jsonl",
            "/root/aime-2024/aime-2024.jsonl",
        ):
            assert path in proc.stderr, path
        problems = proc.stderr.split("pre-flight check failed", 1)[1]
        assert "--load" not in problems and "starting fresh" in proc.stderr  # --load == --save: a first run

    # The resolved values, from the exact argv the script builds (a `python3` stand-in prints it).
    shim = tmp_path / "python3"
    shim.write_text('#!/bin/sh\nshift 2\nprintf "%s\\n" "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "scripts/run-qwen3-4B-fsdp.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    from miles.config import parse_config

    cfg = yaml.safe_load(parse_config(out.stdout.splitlines()).to_yaml())
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
