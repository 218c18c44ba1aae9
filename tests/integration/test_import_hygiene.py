"""Import hygiene, checked in fresh interpreters: what each layer may load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_importing_algo_loads_no_forbidden_module():
    code = (
        "import sys, miles.algo\n"
        "bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')"
        " or m.split('.')[:2] in (['miles', 'config'], ['miles', 'backends'], ['miles', 'rollout'], ['miles', 'ray'])]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_config_import_is_light_and_help_answers() -> None:
    code = textwrap.dedent(
        """
        import sys
        import miles.config
        heavy = sorted(m for m in ("torch", "ray", "transformers", "sglang", "numpy") if m in sys.modules)
        assert not heavy, heavy
        try:
            miles.config.parse_config(["--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--rollout-batch-size" in out.stdout and "--no-colocate" in out.stdout
