"""--expert-model-parallel-size (issue 28): what validation refuses before Ray starts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.config.ep_rules import ep_problems
from miles.preflight import parse_config

BASE = (
    "--prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
    "--global-batch-size 8 --colocate --actor-num-gpus-per-node 4"
)
MOE = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2}


def _checkpoint(tmp_path: Path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**MOE, **config}))
    return str(tmp_path)


def _errors(line: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(shlex.split(line))
    return info.value.violations


def test_ep_problems_of_a_config():
    assert ep_problems(MOE, 2) == [] and ep_problems(MOE, 8) == []
    assert ep_problems(MOE, 3) == ["must divide the model's number of experts (8)"]
    assert any("no MoE experts" in p for p in ep_problems({"num_attention_heads": 4}, 2))
    assert ep_problems({"num_attention_heads": 4}, 1) == []
    assert any("vision-language" in p for p in ep_problems({**MOE, "vision_config": {}}, 2))


def test_ep_run_validates_and_keeps_dp(tmp_path):
    cfg = parse_config(
        shlex.split(f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} --expert-model-parallel-size 2")
    )
    assert cfg.train.expert_model_parallel_size == 2
    # EP does not shrink the data-parallel size (4): --micro-batch-size 2 divides the per-rank batch of 2
    parse_config(
        shlex.split(
            f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} --expert-model-parallel-size 4 --micro-batch-size 2"
        )
    )
    assert (
        parse_config(
            shlex.split(f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE}")
        ).train.expert_model_parallel_size
        == 1
    )


@pytest.mark.parametrize("sizes", ["--expert-model-parallel-size 2", "--expert-model-parallel-size 4"])
def test_ep_with_context_parallelism_validates(tmp_path, sizes):
    """EP over the (dp, cp) ranks, with R3 and the router losses (issue 28)."""
    line = f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} {sizes} --context-parallel-size 2"
    line += " --use-rollout-routing-replay --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001"
    cfg = parse_config(shlex.split(line))
    assert cfg.train.context_parallel_size == 2 and cfg.train.expert_model_parallel_size > 1


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("--expert-model-parallel-size 3", "must divide the actor world size 4"),
        ("--expert-model-parallel-size 2 --tensor-model-parallel-size 2", "--tensor-model-parallel-size"),
        ("--expert-model-parallel-size 2 --lora-rank 8", "--lora-rank"),
        ("--expert-model-parallel-size 2 --advantage-estimator ppo", "--advantage-estimator"),
        ("--expert-model-parallel-size 0", "expert-model-parallel-size"),
    ],
)
def test_ep_refusals_name_the_flag(tmp_path, extra, needle):
    errors = _errors(f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} {extra}")
    assert any(needle in e for e in errors), errors
    if "0" not in extra.split()[1]:
        assert any("issue 28" in e or "world size" in e for e in errors), errors


def test_ep_refuses_dense_and_indivisible_checkpoints(tmp_path):
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    errors = _errors(f"--hf-checkpoint {dense} {BASE} --expert-model-parallel-size 2")
    assert any("--expert-model-parallel-size" in e and "no MoE experts" in e for e in errors), errors
    moe6 = tmp_path / "moe6"
    moe6.mkdir()
    (moe6 / "config.json").write_text(json.dumps({**MOE, "num_experts": 6}))
    errors = _errors(f"--hf-checkpoint {moe6} {BASE} --expert-model-parallel-size 4")
    assert any("number of experts (6)" in e for e in errors), errors
