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
