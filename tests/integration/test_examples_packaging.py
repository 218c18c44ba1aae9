"""The examples are part of the distribution: importable from an installed wheel, not only from the repo root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_calculator_example_imports_from_an_installed_wheel(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
                   check=True, cwd=tmp_path, timeout=300)  # fmt: skip
    (wheel,) = wheels.glob("miles-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    code = (
        "import examples.calculator.tool as t, miles, pathlib; "
        "assert pathlib.Path(t.__file__).is_relative_to(pathlib.Path(miles.__file__).parents[1]); "
        "print(t.calculator('2 + 3', None))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5"
