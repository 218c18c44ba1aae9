"""scripts/side_venv.py's pure parts (the SGLang conformance and TRL venvs).

Making one, and the `side_venv` mark of tests/conftest.py: tests/integration/test_side_venv_make.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import side_venv as sv  # noqa: E402


def test_requirement_names_are_canonical() -> None:
    assert sv.requirement_name("sglang==0.5.23") == "sglang"
    assert sv.requirement_name("ray[default]>=2.40") == "ray"
    assert sv.requirement_name("Partial_JSON.parser") == "partial-json-parser"
    with pytest.raises(ValueError, match="not a requirement"):
        sv.requirement_name("==1.0")


def test_constraints_pin_the_callers_packages_except_what_the_side_venv_pins_itself() -> None:
    installed = {
        "torch": "2.13.0+cpu",
        "transformers": "5.24.0",
        "sentencepiece": "0.1.99",
        "odd": "1-debian",
    }
    text = sv.constraints_text(installed, ["sentencepiece==0.2.1", "pillow", "transformers"], "2.13.0")
    # the caller's torch and transformers as they are; sentencepiece is the side venv's own pin; no invalid version
    assert text.splitlines() == ["torch==2.13.0+cpu", "transformers==5.24.0"]


def test_a_torch_the_caller_lacks_is_pinned_to_the_cpu_build_without_a_gpu() -> None:
    assert sv.constraints_text({"numpy": "2.1.0"}, ["torch"], cpu_torch="2.13.0").splitlines() == [
        "numpy==2.1.0", "torch==2.13.0"
    ]  # fmt: skip
    assert sv.constraints_text({"numpy": "2.1.0"}, ["torch"], cpu_torch=None).splitlines() == ["numpy==2.1.0"]


def test_the_stamp_follows_the_callers_versions_of_what_matters() -> None:
    dirs = ["/x/site-packages"]
    base = {"torch": "2.13.0", "transformers": "5.24.0", "ruff": "0.9.0"}
    key = sv.stamp_key(["trl==1.16.0"], [], "import trl", dirs, base)
    assert key == sv.stamp_key(["trl==1.16.0"], [], "import trl", dirs, {**base, "ruff": "0.10.0"})
    assert key != sv.stamp_key(["trl==1.16.0"], [], "import trl", dirs, {**base, "torch": "2.14.0"})
    assert key != sv.stamp_key(["trl==1.17.0"], [], "import trl", dirs, base)
    assert key != sv.stamp_key(["trl==1.16.0"], [], "import trl", ["/y/site-packages"], base)


def test_project_dependencies_are_pyprojects() -> None:
    deps = sv.project_dependencies()
    assert "httpx" in deps and any(d.startswith("torch") for d in deps)
    assert all(not d.startswith("#") for d in deps)
