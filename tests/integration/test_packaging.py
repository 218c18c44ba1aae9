"""What `pip install` ships: the miles package, examples/ (importable wherever miles is installed, e.g. by a Ray
worker whose working directory is not the repository) and the console scripts."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _can_build_wheels() -> bool:
    """setuptools >= 70.1 builds wheels itself; older ones need the `wheel` package (no network here)."""
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is not None:
        return True
    return importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_wheels(), reason="this Python's setuptools cannot build a wheel offline")
def test_wheel_ships_examples_and_console_scripts(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for name in ("miles", "examples"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("miles-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "examples/__init__.py" in names and "examples/custom_reward.py" in names
    assert "miles/tools/convert_to_hf.py" in names and "miles/tools/plot.py" in names
    assert not any(n.startswith("tests/") for n in names)
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    for script in ("miles-train = miles.train:cli", "miles-convert-to-hf", "miles-plot"):
        assert script in entry_points, script

    # installed somewhere else, the example imports without the repository on sys.path
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    check = subprocess.run(
        [sys.executable, "-c", "import examples.custom_reward as m; print(m.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)},
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip().startswith(str(site))
