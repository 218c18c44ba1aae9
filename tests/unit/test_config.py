"""Tests for miles.config: parsing, YAML merge, validation, SGLang pass-through, round trips."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shlex
import textwrap
from pathlib import Path

import pytest
import yaml

from miles.config import NOT_IMPLEMENTED, Config, ConfigError, build_parser
from miles.config.schema import FIELDS
from miles.preflight import parse_config

# the reference launch line; flash_attention_2 where it had flash_attention_3, which has no context-parallel kernel
# (ring-flash-attn runs FlashAttention-2) and is refused with --context-parallel-size 2
REFERENCE_LINE = """
--hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B --load /root/ckpt --save /root/ckpt --save-interval 20
--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --balance-data --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32
--n-samples-per-prompt 8 --rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256
--use-kl-loss --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00
--entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --optimizer adam --lr 1e-6 --lr-decay-style constant
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --use-wandb --wandb-project miles-dev --wandb-group qwen3-4B
--wandb-key KEY --rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7 --sglang-decode-log-interval 1000
--sglang-chunked-prefill-size 4096 --sglang-attention-backend fa3 --train-backend fsdp
--update-weight-buffer-size 536870912 --gradient-checkpointing --attn-implementation flash_attention_2
--train-env-vars '{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}' --use-dynamic-batch-size
--max-tokens-per-gpu 9216 --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate --use-fault-tolerance
--dump-details /root/dump --fsdp-cpu-offload --context-parallel-size 2 --seed 42
--eval-prompt-data aime /root/aime-2024/aime-2024.jsonl --eval-interval 20 --n-samples-per-eval-prompt 16
--eval-max-response-len 16384
"""

MINIMAL = (
    "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 "
    "--n-samples-per-prompt 2 --global-batch-size 8 --colocate"
)


@pytest.fixture
def reference_argv() -> list[str]:
    return shlex.split(REFERENCE_LINE)


@pytest.fixture
def minimal_argv() -> list[str]:
    return shlex.split(MINIMAL)


def _errors(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    return info.value.violations


def _write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_reference_launch_line_passes(reference_argv: list[str]) -> None:
    cfg = parse_config(reference_argv)
    assert cfg.seed == 42 and cfg.dry_run is False
    assert cfg.cluster.actor_num_gpus_per_node == 8 and cfg.cluster.colocate
    assert cfg.cluster.rollout_num_gpus == 8  # colocate: the actor total
    assert cfg.cluster.train_env_vars == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert cfg.model.attn_implementation == "flash_attention_2" and cfg.model.gradient_checkpointing
    assert cfg.checkpoint.save_interval == 20 and cfg.checkpoint.ref_load == "/root/Qwen3-4B"
    assert cfg.data.input_key == "prompt" and cfg.data.apply_chat_template and cfg.data.rollout_shuffle
    assert cfg.rollout.rollout_batch_size == 32 and cfg.rollout.n_samples_per_prompt == 8
    assert cfg.rollout.rollout_temperature == 1.0 and cfg.rollout.rm_type == "deepscaler"
    assert cfg.train.global_batch_size == 256 and cfg.train.max_tokens_per_gpu == 9216
    assert cfg.train.update_weight_buffer_size == 512 * 1024**2 and cfg.train.context_parallel_size == 2
    assert cfg.optim.lr == 1e-6 and cfg.optim.adam_beta2 == 0.98 and cfg.optim.weight_decay == 0.1
    assert cfg.algo.eps_clip == 0.2 and cfg.algo.eps_clip_high == 0.28
    assert cfg.algo.use_kl_loss and cfg.algo.kl_loss_coef == 0.0 and cfg.algo.kl_loss_type == "low_var_kl"
    assert cfg.eval.eval_prompt_data == ["aime", "/root/aime-2024/aime-2024.jsonl"]
    assert cfg.eval.eval_datasets == [("aime", "/root/aime-2024/aime-2024.jsonl")]
    assert cfg.cluster.actor_world_size == 8
    assert cfg.eval.eval_max_response_len == 16384 and cfg.eval.n_samples_per_eval_prompt == 16
    assert cfg.log.use_wandb and cfg.log.wandb_project == "miles-dev" and cfg.log.dump_details == "/root/dump"
    assert cfg.engine.sglang_mem_fraction_static == 0.7 and cfg.engine.sglang_attention_backend == "fa3"
    assert cfg.engine.sglang_args == {
        "mem_fraction_static": "0.7",
        "decode_log_interval": "1000",
        "chunked_prefill_size": "4096",
        "attention_backend": "fa3",
    }


def test_section_field_names_are_the_agreed_ones() -> None:
    expected = {
        "cluster": "actor_num_nodes actor_num_gpus_per_node rollout_num_gpus rollout_num_gpus_per_engine colocate "
        "use_fault_tolerance cpu_engine_in_trainer rollout_health_check_interval rollout_health_check_timeout "
        "rollout_health_check_first_wait train_env_vars rollout_external rollout_external_engine_addrs",
        "model": "hf_checkpoint attn_implementation gradient_checkpointing freeze_vision_tower fused_elementwise train_dtype",
        "checkpoint": "load ref_load save save_interval keep_last save_hf save_hf_interval",
        "data": "prompt_data input_key label_key metadata_key apply_chat_template multimodal_keys rollout_shuffle",
        "rollout": "rollout_engine num_rollout rollout_batch_size n_samples_per_prompt rollout_max_response_len "
        "rollout_max_prompt_len rollout_temperature rollout_top_p rollout_top_k rollout_stop "
        "rollout_stop_token_ids rollout_skip_special_tokens rollout_seed rm_type custom_rm_path "
        "rm_error_as_zero rollout_request_timeout rollout_timeout reward_key group_rm custom_reward_post_process_path rm_url "
        "rm_timeout rm_max_retries reward_timeout rollout_function_path custom_generate_function_path "
        "dynamic_sampling_filter_path over_sampling_batch_size partial_rollout mask_offpolicy_in_partial_rollout "
        "generate_max_turns generate_execute_tool_function_path generate_tool_timeout "
        "use_session_server agent_function_path agent_timeout fully_async async_max_concurrent_samples "
        "async_data_buffer_capacity_factor async_unused_samples_handler max_weight_staleness "
        "update_weights_interval pause_generation_mode use_rollout_routing_replay session_sample_picker_path "
        "session_sample_postprocessor_path",
        "engine": "engine_host engine_api_key engine_max_running_requests check_weight_update_equal "
        "rollout_weight_quantization rollout_fp8_scale_format sglang_mem_fraction_static "
        "sglang_decode_log_interval sglang_chunked_prefill_size sglang_attention_backend sglang_args",
        "router": "router_policy sglang_router_ip sglang_router_port router_args",
        "train": "train_backend global_batch_size micro_batch_size use_dynamic_batch_size max_tokens_per_gpu "
        "balance_data context_parallel_size tensor_model_parallel_size fsdp_cpu_offload update_weight_buffer_size "
        "update_weight_transfer_mode "
        "update_weight_delta "
        "ref_update_interval "
        "train_timeout refit_timeout moe_aux_loss_coeff moe_z_loss_coeff use_routing_replay expert_model_parallel_size",
        "optim": "optimizer lr min_lr lr_decay_style lr_decay_iters lr_warmup_iters lr_warmup_fraction "
        "weight_decay adam_beta1 adam_beta2 adam_eps clip_grad",
        "algo": "advantage_estimator policy_loss custom_advantage_function_path disable_grpo_std_normalization "
        "normalize_advantages gamma lambd eps_clip eps_clip_high eps_clip_c use_opsm opsm_delta use_kl_loss "
        "kl_loss_coef kl_loss_type kl_coef use_unbiased_kl entropy_coef use_tis tis_clip tis_clip_low use_mis "
        "mis_level mis_lower mis_upper custom_tis_function_path use_rollout_logprobs calculate_per_token_loss "
        "loss_reduction loss_reduction_constant custom_loss_function_path",
        "critic": "critic_load critic_lr critic_lr_warmup_iters num_critic_only_steps value_clip",
        "lora": "lora_rank lora_alpha lora_target_modules lora_dropout lora_refit",
        "eval": "eval_prompt_data eval_interval n_samples_per_eval_prompt eval_max_response_len eval_temperature "
        "eval_top_p eval_top_k eval_input_key eval_label_key skip_eval_before_train eval_function_path",
        "log": "use_wandb use_tensorboard progress wandb_project wandb_group wandb_key wandb_mode run_dir "
        "dump_details log_level",
        "debug": "save_debug_rollout_data load_debug_rollout_data debug_rollout_only debug_train_only",
        None: "seed dry_run config",
    }
    actual: dict[str | None, set[str]] = {}
    for name, spec in FIELDS.items():
        actual.setdefault(spec.section, set()).add(name)
    assert actual == {section: set(names.split()) for section, names in expected.items()}


def test_parser_is_generated_from_the_declarations() -> None:
    parser = build_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    for name, spec in FIELDS.items():
        assert "\n" not in spec.help and spec.help
        if name in ("sglang_args", "router_args"):
            assert "--" + name.replace("_", "-") not in options  # collected, not a flag
            continue
        assert "--" + name.replace("_", "-") in options
        if spec.kind == "bool":
            assert spec.default in (True, False)
            assert "--no-" + name.replace("_", "-") in options


def test_bool_defaults_and_no_forms(minimal_argv: list[str]) -> None:
    cfg = parse_config(minimal_argv)
    assert cfg.cluster.colocate is True
    assert cfg.model.gradient_checkpointing is False and cfg.train.balance_data is False
    cfg = parse_config(
        minimal_argv + ["--gradient-checkpointing", "--no-colocate", "--rollout-num-gpus", "2"]
    )
    assert cfg.model.gradient_checkpointing is True and cfg.cluster.colocate is False
    cfg = parse_config(minimal_argv + ["--gradient-checkpointing", "--no-gradient-checkpointing"])
    assert cfg.model.gradient_checkpointing is False  # last one wins


def test_yaml_merges_under_the_command_line(tmp_path: Path, minimal_argv: list[str]) -> None:
    path = _write_yaml(
        tmp_path,
        """
        lr: 0.5
        adam-beta1: 0.8
        gradient_checkpointing: true
        colocate: true
        rollout:
          rollout-batch-size: 16
        optim:
          weight_decay: 0.2
        """,
    )
    cfg = parse_config(minimal_argv + ["--config", path, "--lr", "0.1", "--no-gradient-checkpointing"])
    assert cfg.optim.lr == 0.1  # CLI beats YAML
    assert cfg.model.gradient_checkpointing is False  # --no- form beats YAML true
    assert cfg.optim.weight_decay == 0.2 and cfg.optim.adam_beta1 == 0.8  # YAML beats defaults
    assert cfg.rollout.rollout_batch_size == 4  # the CLI's value (minimal argv sets it)
    assert cfg.config == path
    cfg = parse_config(["--config", path, "--hf-checkpoint", "/m", "--prompt-data", "/d", "--num-rollout", "1",
                        "--global-batch-size", "16"])  # fmt: skip
    assert cfg.rollout.rollout_batch_size == 16 and cfg.optim.lr == 0.5


def test_unknown_yaml_keys_name_file_and_key(tmp_path: Path, minimal_argv: list[str]) -> None:
    path = _write_yaml(
        tmp_path,
        """
        learning-rate: 0.1
        rollout:
          lr: 0.2
          rollout_batch_sise: 3
        """,
    )
    errors = _errors(minimal_argv + ["--config", path])
    assert len(errors) == 3
    assert f"{path}: unknown key 'learning-rate'" in errors[0]
    assert f"{path}: unknown key 'rollout.lr' (lr belongs in optim)" == errors[1]
    assert "'rollout.rollout_batch_sise'" in errors[2] and "rollout_batch_size" in errors[2]


def test_yaml_file_errors(tmp_path: Path, minimal_argv: list[str]) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config(minimal_argv + ["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_config(minimal_argv + ["--config", _write_yaml(tmp_path, "- 1\n- 2\n")])
    errors = _errors(minimal_argv + ["--config", _write_yaml(tmp_path, "config: other.yaml\nlr: [1]\n")])
    assert any("'config'" in e and "cannot be set inside" in e for e in errors)
    assert any(e.startswith("--lr=[1] [") and str(tmp_path) in e for e in errors)  # names the source file


def test_every_violation_is_listed_at_once() -> None:
    argv = shlex.split(
        "--hf-checkpoint /m --num-rollout 0 --rollout-batch-size 3 --global-batch-size 4 --optimizer adamw "
        "--lr x --train-env-vars {bad --eps-clip-c 0.5 --tis-clip 0.1 --tis-clip-low 0.5 --mis-lower 3 "
        "--save-interval 5 --eval-interval 2 --use-wandb --rollout-temperature 0 --bogus 1 "
        "--use-dynamic-batch-size --actor-num-gpus-per-node 3 --context-parallel-size 2 "
        "--calculate-per-token-loss --loss-reduction sample_mean --eval-prompt-data a"
    )
    errors = _errors(argv)
    expected = [
        "--bogus: unknown flag",
        "--train-env-vars='{bad': invalid JSON",
        "--prompt-data is required",
        "--num-rollout=0: must be >= 1",
        "--rollout-temperature=0.0: must be > 0",
        "--optimizer='adamw': must be one of {adam, sgd}",
        "--lr='x': expected a number",
        "--eps-clip-c=0.5: must be > 1",
        "--loss-reduction='sample_mean': conflicts with --calculate-per-token-loss",
        "--global-batch-size=4: must divide --rollout-batch-size * --n-samples-per-prompt",
        "--context-parallel-size=2: must divide the actor world size 3",
        "--rollout-num-gpus is required without --colocate",
        "--save-interval=5: requires --save",
        "--eval-prompt-data=['a']: expected pairs of NAME PATH",
        "--use-wandb=True: requires --wandb-project",
        "--tis-clip=0.1: must be >= --tis-clip-low=0.5",
        "--mis-lower=3.0: must be <= --mis-upper=2.0",
    ]
    for text in expected:
        assert sum(e.startswith(text) for e in errors) == 1, (text, errors)
    # eval_interval's rule is skipped because eval_prompt_data is already wrong: one mistake, one message
    assert len(errors) == len(expected), errors
    message = str(ConfigError(errors))
    assert message.count("\n  - ") == len(errors)


def test_batch_rules(minimal_argv: list[str]) -> None:
    # world 4, cp 1: static batching needs global_batch_size % dp == 0 and per-rank % micro == 0
    base = minimal_argv + ["--actor-num-gpus-per-node", "4"]
    assert parse_config(base).train.global_batch_size == 8
    assert any("--micro-batch-size=4" in e for e in _errors(base + ["--micro-batch-size", "4"]))
    errors = _errors(base + ["--actor-num-gpus-per-node", "3"])
    assert "--global-batch-size=8: must be a multiple of the data-parallel size 3 (world 3 / cp 1)" in errors
    assert [e for e in errors if not e.startswith(("--global-batch-size", "--rollout-batch-size"))] == []
    dynamic = base + [
        "--actor-num-gpus-per-node",
        "3",
        "--rollout-batch-size",
        "3",
        "--global-batch-size",
        "6",
        "--use-dynamic-batch-size",
    ]
    assert _errors(dynamic)[0].startswith("--max-tokens-per-gpu is required with --use-dynamic-batch-size")
    assert parse_config(dynamic + ["--max-tokens-per-gpu", "100"]).train.use_dynamic_batch_size
    errors = _errors(
        base + ["--no-colocate", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"]
    )
    assert errors == ["--rollout-num-gpus=3: must be a multiple of --rollout-num-gpus-per-engine=2"]


def test_sglang_passthrough(tmp_path: Path, minimal_argv: list[str]) -> None:
    path = _write_yaml(
        tmp_path,
        """
        sglang-context-length: 4096
        sglang-max-running-requests: 1
        engine:
          sglang_args: {log_level: warning}
          sglang-enable-metrics: true
        """,
    )
    argv = minimal_argv + [
        "--config", path, "--sglang-max-running-requests", "2", "--sglang-dtype=bfloat16", "--sglang-disable-radix-cache",
        "--sglang-mem-fraction-static", "0.5", "--sglang-random-seed", "-1",
    ]  # fmt: skip
    cfg = parse_config(argv)
    assert cfg.engine.sglang_mem_fraction_static == 0.5
    assert cfg.engine.sglang_args == {
        "context_length": "4096",
        "max_running_requests": "2",  # CLI beats YAML
        "log_level": "warning",
        "enable_metrics": "true",
        "dtype": "bfloat16",
        "disable_radix_cache": "",  # a bare flag: a switch, launched bare
        "random_seed": "-1",
        "mem_fraction_static": "0.5",  # declared flags land here too
    }
    # a declared flag given through sglang_args fills the typed field
    cfg = Config.from_dict({**cfg.to_dict(), "engine": {"sglang_args": {"chunked_prefill_size": "512"}}})
    assert cfg.engine.sglang_chunked_prefill_size == 512
    with pytest.raises(ConfigError, match=r"sglang_args\['mem_fraction_static'\]='lots': expected a number"):
        Config.from_dict({**cfg.to_dict(), "engine": {"sglang_args": {"mem_fraction_static": "lots"}}})


def test_unknown_and_malformed_cli(minimal_argv: list[str]) -> None:
    errors = _errors(["stray"] + minimal_argv + ["--rollout-batch", "3", "--colocat", "--num-rollouts=4"])
    assert errors == [
        "unexpected argument 'stray' (flags start with --)",
        "--rollout-batch: unknown flag (did you mean '--rollout-batch-size'?)",
        "--colocat: unknown flag (did you mean '--colocate'?)",
        "--num-rollouts: unknown flag (did you mean '--num-rollout'?)",
    ]
    with pytest.raises(ConfigError, match="expected one argument"):
        parse_config(minimal_argv + ["--lr"])


def test_round_trips(reference_argv: list[str], tmp_path: Path) -> None:
    cfg = parse_config(reference_argv)
    d = cfg.to_dict()
    assert set(d) == {"seed", "dry_run", "config", "cluster", "model", "checkpoint", "data", "rollout",
                      "engine", "router", "train", "optim", "algo", "critic", "lora", "eval", "log", "debug"}  # fmt: skip
    assert Config.from_dict(d) == cfg
    assert Config.from_dict(json.loads(json.dumps(d))) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert Config.from_dict(yaml.safe_load(cfg.to_yaml(redact_secrets=False))) == cfg
    # the dry-run YAML is itself a valid --config file
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml(redact_secrets=False).replace("config: null\n", ""))
    again = parse_config(["--config", str(path)])
    assert dataclasses.replace(again, config=None) == cfg
    # to_dict hands out copies
    d["engine"]["sglang_args"]["x"] = "1"
    d["eval"]["eval_prompt_data"].append("y")
    assert "x" not in cfg.engine.sglang_args and len(cfg.eval.eval_prompt_data) == 2


def test_to_yaml_redacts_secrets(reference_argv: list[str]) -> None:
    text = parse_config(reference_argv).to_yaml()
    loaded = yaml.safe_load(text)
    assert loaded["log"]["wandb_key"] == "<redacted>" and "KEY" not in text.split()
    assert loaded["engine"]["engine_api_key"] is None


def test_config_is_frozen(minimal_argv: list[str]) -> None:
    cfg = parse_config(minimal_argv)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.rollout_batch_size = 1  # type: ignore[misc]


def test_raise_if_unimplemented(minimal_argv: list[str], monkeypatch) -> None:
    from types import MappingProxyType

    assert "use_fault_tolerance" not in NOT_IMPLEMENTED  # built now
    for name, spec in FIELDS.items():
        assert spec.meta("implemented") is (name not in NOT_IMPLEMENTED)
    cfg = parse_config(minimal_argv + ["--use-fault-tolerance"])
    cfg.raise_if_unimplemented()
    # the mechanism, on a field marked unbuilt for this test
    field = FIELDS["use_fault_tolerance"].field
    monkeypatch.setattr(field, "metadata", MappingProxyType({**field.metadata, "implemented": False}))
    parse_config(minimal_argv).raise_if_unimplemented()  # defaults: nothing to report
    parse_config(minimal_argv + ["--no-use-fault-tolerance"]).raise_if_unimplemented()  # = the default
    with pytest.raises(NotImplementedError, match=r"--use-fault-tolerance=True"):
        cfg.raise_if_unimplemented()


def test_derived_values(minimal_argv: list[str]) -> None:
    cfg = parse_config(minimal_argv + ["--eps-clip", "0.3", "--rollout-temperature", "0.7"])
    assert cfg.algo.eps_clip_high == 0.3
    assert cfg.eval.eval_temperature == 0.7 and cfg.eval.eval_max_response_len == 1024
    assert cfg.algo.loss_reduction == "sample_mean" and cfg.algo.loss_reduction_constant == 1024.0
    assert cfg.optim.lr_decay_iters == 2  # num_rollout * (4 * 2 / 8) optimizer steps
    assert cfg.cluster.rollout_num_gpus == 1
    assert re.fullmatch(r"runs/\d{8}-\d{6}", cfg.log.run_dir)
    cfg = parse_config(minimal_argv + ["--calculate-per-token-loss"])
    assert cfg.algo.loss_reduction == "token_mean"
    cfg = parse_config(minimal_argv + ["--loss-reduction", "token_mean", "--eval-temperature", "0"])
    assert cfg.algo.calculate_per_token_loss and cfg.eval.eval_temperature == 0.0
    assert parse_config(minimal_argv + ["--calculate-per-token-loss", "--loss-reduction", "token_mean"])


def test_train_backend_choices_come_from_the_registry(monkeypatch: pytest.MonkeyPatch, minimal_argv) -> None:
    errors = _errors(minimal_argv + ["--train-backend", "megatron"])
    assert errors == ["--train-backend='megatron': must be one of {fsdp}"]
    import miles.backends

    monkeypatch.setitem(miles.backends._BACKENDS, "megatron", "nowhere:Trainer")
    assert parse_config(minimal_argv + ["--train-backend", "megatron"]).train.train_backend == "megatron"


def test_train_env_vars(minimal_argv: list[str]) -> None:
    cfg = parse_config(minimal_argv + ["--train-env-vars", '{"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": 1}'])
    assert cfg.cluster.train_env_vars == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1"}
    errors = _errors(minimal_argv + ["--train-env-vars", '["NCCL_DEBUG"]'])
    assert errors == ["--train-env-vars='[\"NCCL_DEBUG\"]': expected a JSON object of strings, got list"]
    assert _errors(minimal_argv + ["--train-env-vars", '{"A": {"B": 1}}'])[0].endswith(
        "value of 'A': expected a scalar (string, number or boolean), got dict"
    )


def test_lists_and_function_paths(minimal_argv: list[str]) -> None:
    cfg = parse_config(
        minimal_argv + ["--rollout-stop", "</s>", "\n\n", "--rollout-stop-token-ids", "1", "2"]
    )
    assert cfg.rollout.rollout_stop == ["</s>", "\n\n"] and cfg.rollout.rollout_stop_token_ids == [1, 2]
    assert _errors(minimal_argv + ["--rollout-top-k", "0"]) == [
        "--rollout-top-k=0: must be -1 (disabled) or >= 1"
    ]
    assert parse_config(minimal_argv + ["--rollout-top-k", "-1"]).rollout.rollout_top_k == -1
    assert _errors(minimal_argv + ["--rollout-stop-token-ids", "1", "-2"]) == [
        "--rollout-stop-token-ids=[1, -2]: must be >= 0 (each item)"
    ]
    cfg = parse_config(minimal_argv + ["--custom-rm-path", "my_pkg.rewards:score"])
    assert cfg.rollout.custom_rm_path == "my_pkg.rewards:score"
    assert _errors(minimal_argv + ["--custom-loss-function-path", "not a path"])[0].startswith(
        "--custom-loss-function-path='not a path': expected 'module.path:function'"
    )


def test_flash_attention_3_with_context_parallelism_is_refused(minimal_argv: list[str]) -> None:
    argv = minimal_argv + ["--attn-implementation", "flash_attention_3"]
    assert parse_config(argv).model.attn_implementation == "flash_attention_3"
    (error,) = _errors(argv + ["--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"])
    assert error.startswith("--attn-implementation='flash_attention_3': has no context-parallel kernel")
    assert "flash_attention_2" in error
    cfg = parse_config(minimal_argv + ["--attn-implementation", "flash_attention_2", "--context-parallel-size", "2",
                                       "--actor-num-gpus-per-node", "2"])  # fmt: skip
    assert cfg.train.context_parallel_size == 2
