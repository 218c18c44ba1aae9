"""Hybrid (linear-attention) checkpoints at validation (issue 28): CP and TP (and EP where the flag exists) are
refused naming the flag; the same sizes pass for a checkpoint without linear-attention layers."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.config.hybrid_rules import has_linear_attention_layers
from miles.preflight import parse_config

BASE = (
    "--prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
    "--global-batch-size 8 --colocate --actor-num-gpus-per-node 4"
)
HYBRID = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "layer_types": ["linear_attention", "full_attention"],
}


def _checkpoint(tmp_path: Path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**HYBRID, **config}))
    return str(tmp_path)


def _errors(line: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(shlex.split(line))
    return info.value.violations


def test_linear_attention_layers_read_from_config(tmp_path):
    assert has_linear_attention_layers(_checkpoint(tmp_path))
    assert not has_linear_attention_layers(_checkpoint(tmp_path, layer_types=["full_attention"] * 2))
    assert not has_linear_attention_layers(str(tmp_path / "missing"))
    assert not has_linear_attention_layers(None)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        ("--context-parallel-size 2", "--context-parallel-size"),
        ("--tensor-model-parallel-size 2", "--tensor-model-parallel-size"),
    ],
)
def test_hybrid_refuses_cp_and_tp_naming_the_flag(tmp_path, extra, flag):
    errors = _errors(f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} {extra}")
    hits = [e for e in errors if e.startswith(flag) and "linear-attention" in e]
    assert hits and all("issue 28" in e for e in hits), errors


def test_same_sizes_pass_without_linear_attention(tmp_path):
    dense = _checkpoint(tmp_path, layer_types=["full_attention"] * 2)
    for extra in ("--context-parallel-size 2", "--tensor-model-parallel-size 2"):
        parse_config(shlex.split(f"--hf-checkpoint {dense} {BASE} {extra}"))
    parse_config(shlex.split(f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE}"))
