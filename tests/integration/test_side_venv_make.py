"""scripts/side_venv.py for real: a side venv over this interpreter's packages (no package index needed), and the
`side_venv` mark of tests/conftest.py (skip, or fail under CI=true). Its pure parts: tests/unit/test_side_venv.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import side_venv as sv  # noqa: E402


def test_a_side_venv_runs_the_callers_packages_and_is_cached(tmp_path: Path) -> None:
    """No package index needed: nothing to install, only the layering over this interpreter's site directories."""
    import yaml  # one of the caller's packages (a miles dependency)

    venv = tmp_path / "side"
    logs: list[str] = []
    check = "import sys, yaml; print(yaml.__file__); print(*sys.path, sep='\\n')"
    assert sv.missing_reason(venv, "ok", "make it") == f"{venv} is not ready (make it with: make it)"
    assert sv.make(venv, "ok", [], check=check, log=logs.append)
    assert sv.missing_reason(venv, "ok", "make it") is None
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True, check=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).stdout.splitlines()  # fmt: skip
    assert out[0] == yaml.__file__  # the caller's, whether the caller is a venv or the system Python
    own = [i for i, p in enumerate(out) if p.startswith(str(venv))]
    callers = [i for i, p in enumerate(out) if p in sv.calling_site_dirs()]
    assert own and callers and max(own) < min(callers)  # what the side venv installs comes first

    made = (venv / "pyvenv.cfg").stat().st_mtime_ns
    n = len(logs)
    assert sv.make(venv, "ok", [], check=check, log=logs.append)
    assert (venv / "pyvenv.cfg").stat().st_mtime_ns == made and len(logs) == n  # the stamp matched: kept

    # a check that does not run: no stamp, the reason in the log and in the skip reason
    assert not sv.make(venv, "ok", [], check="import no_such_module_anywhere", log=logs.append)
    assert not (venv / "ok").exists()
    assert sv.missing_reason(venv, "ok", "make it") == (
        f"{venv} is not ready (make it with: make it); {venv / sv.ERROR_LOG}: "
        f"the check does not run in {venv}: ModuleNotFoundError: No module named 'no_such_module_anywhere'"
    )


MARKED = """
from pathlib import Path
import pytest

pytestmark = pytest.mark.side_venv(Path({venv!r}), "ok", "bash make-it.sh")


def test_judge():
    pass
"""


@pytest.mark.parametrize("ci", ["", "true"])
def test_a_judge_without_its_venv_skips_or_fails_under_ci(ci: str, tmp_path: Path) -> None:
    test = tmp_path / "test_marked.py"
    test.write_text(MARKED.format(venv=str(tmp_path / "none")))
    env = dict(os.environ, CI=ci, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(test)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    text = (out.stdout + out.stderr)[-3000:]
    assert f"{tmp_path / 'none'} is not ready (make it with: bash make-it.sh)" in text, text
    if ci:
        assert out.returncode == 1 and "1 error" in text and "CI=true: this suite must run" in text, text
    else:
        assert out.returncode == 0 and "1 skipped" in text, text
