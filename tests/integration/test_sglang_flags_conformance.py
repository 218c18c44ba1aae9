"""`--sglang-*` flags and the sglang-router pass-through in processes of their own: what validation imports, `--help`
without sglang-router, and, in the SGLang conformance venv, every SGLang 0.5.23 `ServerArgs` field through miles's
parser and launch path into SGLang's own parser (tests/sglang_conformance/flag_walk.py), `--dry-run` refusing a
value SGLang refuses, and an admin key starting with '-'. The in-process side: tests/unit/test_sglang_flags.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS_PYTHON = ROOT / "tests" / "sglang_conformance" / "python"
VENV = Path(os.environ.get("MILES_SGLANG_VENV", ROOT / ".venv-sglang"))
MINIMAL = shlex.split(
    "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 "
    "--n-samples-per-prompt 2 --global-batch-size 8 --colocate"
)
# skips with the reason without the venv, fails under CI=true (tests/conftest.py)
needs_sglang_venv = pytest.mark.side_venv(VENV, ".miles-sglang-ok", "bash scripts/sglang-venv.sh")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def _harness(*args: str) -> subprocess.CompletedProcess[str]:
    """The conformance venv's python (miles from this checkout on its path)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [str(HARNESS_PYTHON), *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )


def test_validation_without_sglang_imports_neither_sglang_nor_torch():
    code = (
        "import sys\n"
        "sys.modules['sglang'] = None  # as where SGLang is not installed\n"
        "from miles.preflight import parse_config\n"
        f"parse_config({MINIMAL + ['--sglang-attention-backend', 'nope', '--sglang-enable-metrics']!r})\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_help_and_a_run_without_router_flags_need_no_sglang_router():
    code = (
        "import sys\n"
        "sys.modules['sglang_router'] = sys.modules['sglang_router.router_args'] = None\n"
        "from miles.config import ConfigError\nfrom miles.preflight import parse_config\n"
        f"MINIMAL = {MINIMAL!r}\n"
        "assert parse_config(MINIMAL).router.router_args == {}\n"
        "try:\n"
        "    parse_config(MINIMAL + ['--router-policy', 'cache_aware', '--router-cache-threshold', '0.5'])\n"
        "except ConfigError as e:\n"
        "    print('\\n'.join(e.violations))\n"
        "from miles.train import main\n"
        "main(['--help'])\n"
    )
    out = _python(code)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "--router-policy='cache_aware': cannot be checked: sglang-router is not installed"
    )
    assert lines[1].startswith(
        "--router-cache-threshold='0.5': cannot be checked or passed on: sglang-router is"
    )
    assert "pip install sglang-router" in lines[0] and lines[2].startswith("usage: python -m miles.train")
    assert "--router-policy STR" in out.stdout


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> dict:
    from miles.tools.tiny_model import build_word_model

    model = build_word_model(tmp_path_factory.mktemp("walk"), seed=0)
    out = _harness(str(ROOT / "tests" / "sglang_conformance" / "flag_walk.py"), str(model))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_sglang_venv
@pytest.mark.slow
def test_every_server_args_field_reaches_sglang_as_given(walk):
    """Each of SGLang 0.5.23's ServerArgs fields: given through `--sglang-NAME` on the command line, in a YAML file,
    switched off, and by each alias, it lands in its field with the value SGLang's own command line gives it."""
    assert walk["errors"] == [] and walk["mismatches"] == []
    assert walk["runs"] == ["cli", "yaml", "off", "aliases"]
    # every field is walked, or is miles's to set, or has no SGLang flag; both of the latter are refused
    walked, owned, no_cli = (
        set(walk["walked_dests"]),
        set(walk["refused"]) - set(walk["no_cli_fields"]),
        set(walk["no_cli_fields"]),
    )
    assert len(walked | (owned - {"config", "help"}) | no_cli) == walk["fields"] == 546
    assert walk["switches"] == 173 and len(walk["switches_with_no_form"]) == 12 and len(walk["aliases"]) == 14
    for name, violations in walk["refused"].items():
        flag = "--sglang-" + name.replace("_", "-")
        assert violations and violations[0].startswith(flag + "='1': "), (name, violations)
        why = "cannot be passed through" if name in owned else "SGLang has no such option"
        assert why in violations[0], violations
    # a value equal to the default would not show a lost flag: only where no other value exists
    assert walk["unchanged"] == {
        "--mm-global-cache-backend": "its only choice is the default",
        "--dllm-fdfo": "a switch on by default (the off run changes it)",
    }


@needs_sglang_venv
@pytest.mark.slow
def test_an_admin_key_starting_with_a_dash_reaches_sglang(walk):
    """SGLang's whole start-up parse (`prepare_server_args`) of an engine's command line, its key drawn with a
    leading '-' (secrets.token_urlsafe does that about once in 64 runs)."""
    assert walk["prepared"] == {"admin_api_key": "-" + "k" * 42, "random_seed": 42}


@needs_sglang_venv
@pytest.mark.slow
def test_dry_run_refuses_a_value_sglang_refuses(tmp_path):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    model = build_tiny_model(tmp_path / "model", hidden_size=16, num_layers=1)
    data = write_jsonl(make_rows("echo", 8), tmp_path / "data.jsonl")
    run = [
        "-m", "miles.train", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt",
        "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "8", "--colocate", "--run-dir", str(tmp_path / "run"), "--dry-run",
        "--sglang-enable-metrics", "--sglang-enable-deterministic-inference", "true",
    ]  # fmt: skip
    good = _harness(*run)
    assert good.returncode == 0, good.stderr[-3000:]
    assert "enable_metrics: ''" in good.stdout and "enable_deterministic_inference: 'true'" in good.stdout
    bad = _harness(*run, "--sglang-attention-backend", "nope", "--sglang-enable-metric")
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "invalid configuration (2 problems):" in bad.stderr
    assert (
        "--sglang-attention-backend='nope': SGLang refuses it: argument --attention-backend: invalid choice: 'nope'"
        in bad.stderr
    )
    assert (
        "--sglang-enable-metric: SGLang has no such option (did you mean '--sglang-enable-metrics'?)"
        in bad.stderr
    )
