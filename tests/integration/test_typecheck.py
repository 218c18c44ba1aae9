"""The typed code passes mypy: configuration, algorithms, drivers, the rollout side, utilities, tools, the embedded
engine and the system set-up (files and settings in pyproject.toml's [tool.mypy]). mypy comes with the `test` extra
(`pip install -e ".[test]"`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_passes_on_the_typed_code():
    assert importlib.util.find_spec("mypy") is not None, 'mypy is missing: pip install -e ".[test]"'
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", "/dev/null"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success" in proc.stdout, proc.stdout


def test_ruff_passes_on_the_whole_tree():
    """Lint (pyproject.toml's [tool.ruff]) over the package, scripts and tests: catches, e.g., a name a refactor
    moved away from a script nothing imports (an undefined `free_port` once broke scripts/bench/refit.py)."""
    assert importlib.util.find_spec("ruff") is not None, 'ruff is missing: pip install -e ".[test]"'
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "miles", "scripts", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
