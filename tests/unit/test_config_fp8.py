"""--rollout-weight-quantization fp8: the SGLang launch flags it adds, the scale format's default, and the
conflicts refused at validation (each naming the flag)."""

from __future__ import annotations

import json

import pytest

from miles.config import ConfigError, parse_config

BASE = "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 --global-batch-size 4 --colocate"


def violations(extra: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config([*BASE.split(), *extra])
    return info.value.violations


def test_off_by_default_and_sglang_args_untouched() -> None:
    cfg = parse_config(BASE.split())
    assert cfg.engine.rollout_weight_quantization is None
    assert cfg.engine.rollout_fp8_scale_format == "float"
    assert "quantization" not in cfg.engine.sglang_args
    assert "json_model_override_args" not in cfg.engine.sglang_args


def test_fp8_launches_sglang_with_the_block_fp8_quantization_config() -> None:
    cfg = parse_config([*BASE.split(), "--rollout-weight-quantization", "fp8"])
    args = cfg.engine.sglang_args
    assert args["quantization"] == "fp8"
    assert json.loads(args["json_model_override_args"]) == {
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    }


def test_deep_gemm_moe_runner_picks_ue8m0_and_user_overrides_are_kept() -> None:
    cfg = parse_config([
        *BASE.split(), "--rollout-weight-quantization", "fp8", "--sglang-moe-runner-backend", "deep_gemm",
        "--sglang-json-model-override-args", '{"max_position_embeddings": 512}',
    ])  # fmt: skip
    assert cfg.engine.rollout_fp8_scale_format == "ue8m0"
    override = json.loads(cfg.engine.sglang_args["json_model_override_args"])
    assert override["max_position_embeddings"] == 512
    assert override["quantization_config"]["scale_fmt"] == "ue8m0"
    explicit = parse_config([*BASE.split(), "--rollout-weight-quantization", "fp8",
                             "--rollout-fp8-scale-format", "float", "--sglang-moe-runner-backend", "deep_gemm"])  # fmt: skip
    assert explicit.engine.rollout_fp8_scale_format == "float"


def test_a_resolved_fp8_config_reads_back_the_same() -> None:
    from miles.config import Config

    cfg = parse_config(
        [*BASE.split(), "--rollout-weight-quantization", "fp8", "--sglang-moe-runner-backend", "deep_gemm"]
    )
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rollout-weight-quantization", "int4"], "--rollout-weight-quantization"),
        (
            ["--rollout-weight-quantization", "fp8", "--sglang-quantization", "awq"],
            "--sglang-quantization='awq'",
        ),
        (
            [
                "--rollout-weight-quantization",
                "fp8",
                "--sglang-json-model-override-args",
                '{"quantization_config": {}}',
            ],
            "drop quantization_config",
        ),
        (["--rollout-fp8-scale-format", "ue8m0"], "add --rollout-weight-quantization fp8"),
        (
            ["--rollout-weight-quantization", "fp8", "--rollout-fp8-scale-format", "e8"],
            "--rollout-fp8-scale-format",
        ),
    ],
)
def test_conflicts_are_refused_naming_the_flag(extra: list[str], message: str) -> None:
    found = violations(extra)
    assert any(message in v for v in found), found
