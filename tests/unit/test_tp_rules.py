"""--tensor-model-parallel-size (issue 28): the (dp, cp, tp) arithmetic and what validation refuses before Ray starts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.config.tp_rules import tp_problems
from miles.preflight import parse_config
from miles.utils.parallel_dims import ParallelDims

BASE = (
    "--prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
    "--global-batch-size 8 --colocate --actor-num-gpus-per-node 4"
)
QWEN3 = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}


def _checkpoint(tmp_path: Path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3, **config}))
    return str(tmp_path)


def _errors(line: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(shlex.split(line))
    return info.value.violations


def test_tp_is_the_innermost_mesh_dimension():
    dims = ParallelDims(world_size=8, cp_size=1, tp_size=2)
    assert dims.dp_size == 4 and dims.replica_size == 2
    assert [dims.coords(r)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert ParallelDims(world_size=8, cp_size=2, tp_size=2).coords(5) == (1, 0)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size=4 must divide"):
        ParallelDims(world_size=6, tp_size=4)


def test_tp_problems_of_a_config():
    assert tp_problems(QWEN3, 2) == []
    assert tp_problems({**QWEN3, "num_key_value_heads": 1}, 4) == [
        "must divide the model's num_key_value_heads=1"
    ]
    assert any("MoE" in p for p in tp_problems({**QWEN3, "num_experts": 8}, 2))
    assert tp_problems({**QWEN3, "num_experts": 8, "model_type": "qwen3_moe"}, 2) == []  # experts kept whole
    for other in (
        {"model_type": "mixtral", "num_local_experts": 8},
        {"model_type": "qwen3_next", "num_experts": 8},
    ):
        assert any(
            "MoE" in p and "issue 28" in p and "qwen3_moe" in p for p in tp_problems({**QWEN3, **other}, 2)
        )
    assert any("vision-language" in p for p in tp_problems({**QWEN3, "vision_config": {}}, 2))


def test_tp_run_validates_and_dp_shrinks(tmp_path):
    cfg = parse_config(
        shlex.split(f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} --tensor-model-parallel-size 2")
    )
    assert cfg.train.tensor_model_parallel_size == 2
    # dp = 4 / 2 = 2: a global batch of 8 is 4 per DP rank, so --micro-batch-size 3 does not divide it
    errors = _errors(
        f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} --tensor-model-parallel-size 2 --micro-batch-size 3"
    )
    assert any("per-rank batch 4" in e for e in errors), errors


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        ("--tensor-model-parallel-size 3", "--tensor-model-parallel-size"),
        ("--tensor-model-parallel-size 2 --context-parallel-size 2", "--context-parallel-size"),
        ("--tensor-model-parallel-size 2 --lora-rank 4 --lora-target-modules q_proj", "--lora-rank"),
        ("--tensor-model-parallel-size 2 --advantage-estimator ppo", "--advantage-estimator"),
    ],
)
def test_tp_refusals_name_the_flag(tmp_path, extra, flag):
    errors = _errors(f"--hf-checkpoint {_checkpoint(tmp_path)} {BASE} {extra}")
    assert any(e.startswith(flag) or flag in e.split(":")[0] for e in errors), errors


def test_tp_must_divide_the_checkpoint_heads(tmp_path):
    errors = _errors(
        f"--hf-checkpoint {_checkpoint(tmp_path, num_key_value_heads=1)} {BASE} --tensor-model-parallel-size 2"
    )
    assert any(
        "--tensor-model-parallel-size" in e and "num_key_value_heads=1" in e and "issue 28" not in e
        for e in errors
    )
    errors = _errors(
        f"--hf-checkpoint {_checkpoint(tmp_path, num_experts=4)} {BASE} --tensor-model-parallel-size 2"
    )
    assert any("MoE" in e and "issue 28" in e for e in errors), errors


def test_tp_accepts_qwen3_moe_with_its_losses_and_replay(tmp_path):
    ckpt = _checkpoint(tmp_path, model_type="qwen3_moe", num_experts=4)
    cfg = parse_config(
        shlex.split(
            f"--hf-checkpoint {ckpt} {BASE} --tensor-model-parallel-size 2 --moe-aux-loss-coeff 0.01 "
            "--use-rollout-routing-replay --use-routing-replay"
        )
    )
    assert cfg.train.tensor_model_parallel_size == 2
    errors = _errors(
        f"--hf-checkpoint {ckpt} {BASE} --tensor-model-parallel-size 2 --expert-model-parallel-size 2"
    )
    assert any("--expert-model-parallel-size" in e and "issue 28" in e for e in errors), errors
