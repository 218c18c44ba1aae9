"""Start-up cost guard (issue 30): each miles process imports only what its first step needs. Every check runs the
process's own start-up path in a fresh interpreter and fails if a module listed as not needed there comes back
(each costs CPU-seconds on every run; on 2 cores start-up is bound by the CPU of all processes together)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# a model dir the rollout manager can start from: the tiny tokenizer (generic class) and a config naming its type
MODEL_FILES = """
import json, pathlib, sys
from miles.tools.tiny_model import _portable_tokenizer_config, build_tokenizer
out = pathlib.Path(sys.argv[1])
build_tokenizer("echo").save_pretrained(out)
_portable_tokenizer_config(out / "tokenizer_config.json")
(out / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
"""

ROLLOUT_MANAGER = """
import sys
from miles.config import parse_config
from miles.ray.rollout_manager import RolloutManager
cfg = parse_config(sys.argv[1:])
RolloutManager(cfg)
"""

DRIVER_PREFLIGHT = """
import sys
from miles.config import parse_config
from miles.preflight.checks import reward_problems, rollout_function_problems
cfg = parse_config(sys.argv[1:])
assert not reward_problems(cfg.rollout.rm_type, None), "reward"
assert not rollout_function_problems(cfg), "seams"
"""

TRAINER = "from miles.backends import get_policy_class; get_policy_class('fsdp')"  # as a training rank does

REPORT = "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"

HTTPX_CLI = ("httpx._main", "click", "rich", "pygments")
NOT_IN_ANY = ("peft", "datasets", "pandas", "wandb", "tensorboard", "matplotlib", "sglang", "sklearn")
NOT_NEEDED = {
    # the rollout manager holds no model: no torch (~130 MB and ~1 s of CPU), no transformers model registry
    "rollout manager": ("torch", "transformers.models", "miles.backends", *HTTPX_CLI, *NOT_IN_ANY),
    "driver preflight": ("torch", "ray", "transformers", "miles.backends", *HTTPX_CLI, *NOT_IN_ANY),
    # the trainer builds a model with transformers, but no rollout or engine code, no optional extras, not
    # scipy (transformers' object-detection losses) and not trio (its HTTP client's; miles.utils.transformers_import)
    "trainer": ("miles.rollout", "miles.engines", "scipy", "trio", *HTTPX_CLI, *NOT_IN_ANY),
}


def _imported(code: str, args: list[str]) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + REPORT, *args], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _heavy(imported: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if n in imported or any(m.startswith(n + ".") for m in imported))


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("lean")
    subprocess.run([sys.executable, "-c", MODEL_FILES, str(root / "model")], check=True, timeout=120)
    (root / "data.jsonl").write_text(json.dumps({"prompt": "say 3", "label": "3"}) + "\n")
    return (
        f"--hf-checkpoint {root / 'model'} --prompt-data {root / 'data.jsonl'} --input-key prompt "
        "--label-key label --rm-type math --rollout-batch-size 1 --n-samples-per-prompt 2 "
        "--global-batch-size 2 --num-rollout 1 --actor-num-gpus-per-node 1 --colocate"
    ).split()


@pytest.mark.parametrize(
    "process, code",
    [("rollout manager", ROLLOUT_MANAGER), ("driver preflight", DRIVER_PREFLIGHT), ("trainer", TRAINER)],
    ids=["rollout_manager", "driver_preflight", "trainer"],
)
def test_process_imports_nothing_its_first_step_does_not_need(process: str, code: str, flags) -> None:
    imported = _imported(code, flags)
    assert len(imported) > 50, "the check saw no imports"
    assert not _heavy(imported, NOT_NEEDED[process]), (
        f"{process} imported {_heavy(imported, NOT_NEEDED[process])}"
    )
