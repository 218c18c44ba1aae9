"""Suite-wide setup: no model hub, no tokenizer thread pools, unbuffered output (set once, before any test); and
the `side_venv` mark.

`pytest.mark.side_venv(venv, stamp, make)` marks tests that run a child in a side venv (scripts/side_venv.py:
the SGLang conformance venv, the TRL venv). When `venv` is not ready (no `stamp` file) they skip, saying why and
which command `make` makes it; under `CI=true` they fail instead: these suites are how we know miles speaks
SGLang and computes TRL's gradient, and a CI run that skips them proves neither.
"""

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "side_venv(venv, stamp, make): needs a side venv; skips without it, fails under CI=true"
    )


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _side_venv_module():  # noqa: ANN202 - scripts/side_venv.py, which is not a package
    spec = importlib.util.spec_from_file_location("side_venv", ROOT / "scripts" / "side_venv.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("side_venv"):
        venv, stamp, make = mark.args
        reason = _side_venv_module().missing_reason(Path(venv), stamp, make)
        if reason is None:
            continue
        if in_ci():
            pytest.fail(f"CI=true: this suite must run, but {reason}", pytrace=False)
        pytest.skip(reason)
