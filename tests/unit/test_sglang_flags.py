"""`--sglang-*` flags without SGLang installed: how they are recorded, launched, turned into SGLang's form and
refused; the run's seed promise on SGLang engines. In other processes (imports, sglang-router missing, SGLang
0.5.23's own parser in the conformance venv): tests/integration/test_sglang_flags_conformance.py."""

from __future__ import annotations

import argparse
import logging
import shlex

import pytest

from miles.config import ConfigError
from miles.engines import sglang_args
from miles.engines.sglang_args import flag_args, sglang_form, sglang_seeds_requests
from miles.engines.sglang_engine import EngineProcess, engine_launch_kwargs
from miles.engines.sglang_launch import ADMIN_API_KEY_ENV, argv_with_keys
from miles.preflight import parse_config

MINIMAL = shlex.split(
    "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 "
    "--n-samples-per-prompt 2 --global-batch-size 8 --colocate"
)


def _sglang(*flags: str) -> dict[str, str]:
    return dict(parse_config(MINIMAL + list(flags)).engine.sglang_args)


def _errors(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(MINIMAL + argv)
    return e.value.violations


def _fake_sglang_parser() -> argparse.ArgumentParser:
    """The shapes of option SGLang 0.5.23 declares (see the conformance test for the real parser)."""
    p = sglang_args._Parser(add_help=False, allow_abbrev=False)
    p.add_argument("--model-path", required=True)
    p.add_argument("--enable-metrics", action="store_true")  # a plain switch
    p.add_argument("--enable-hierarchical-cache", "--enable-hicache", action="store_true")  # with an alias
    p.add_argument("--dllm-fdfo", action=argparse.BooleanOptionalAction, default=True)  # both forms
    p.add_argument("--cuda-graph-bs-decode", type=int, nargs="+")
    p.add_argument("--lora-paths", nargs="*")
    p.add_argument("--model-checksum", nargs="?", const="auto")
    p.add_argument("--attention-backend", choices=["fa3", "triton"])
    p.add_argument("--json-model-override-args", type=str)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int)
    return p


# ---------------------------------------------------------------------------------------- recording (parser)


def test_a_switch_without_a_value_is_recorded_as_given_bare():
    args = _sglang("--sglang-enable-metrics", "--sglang-skip-server-warmup")
    assert args == {"enable_metrics": "", "skip_server_warmup": ""}


def test_values_as_given():
    args = _sglang(
        "--sglang-enable-deterministic-inference", "false", "--sglang-served-model-name", "-x",
        "--sglang-json-model-override-args", '{"a": 1}', "--sglang-cuda-graph-bs-decode", "1", "2", "4",
        "--sglang-random-seed=-1", "--sglang-model-checksum=",
    )  # fmt: skip
    assert args == {
        "enable_deterministic_inference": "false",
        "served_model_name": "-x",  # one dash: a value, not a flag
        "json_model_override_args": '{"a": 1}',  # one value with spaces stays one value
        "cuda_graph_bs_decode": "1 2 4",  # several values: one shell-quoted string
        "random_seed": "-1",
        "model_checksum": "",
    }
    assert (
        _sglang("--sglang-lora-paths", "a=/p", '{"lora_name": "n"}')["lora_paths"]
        == 'a=/p \'{"lora_name": "n"}\''
    )


def test_yaml_switches_lists_and_nulls(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "sglang-enable-metrics: true\nsglang_dllm_fdfo: false\nsglang-cuda-graph-bs-decode: [1, 2]\n"
        "engine:\n  sglang_args: {skip-server-warmup: null, log_level: warning}\n"
    )
    args = _sglang("--config", str(path))
    assert args == {
        "enable_metrics": "true",
        "dllm_fdfo": "false",
        "cuda_graph_bs_decode": "1 2",
        "skip_server_warmup": "",  # a key without a value: the bare switch
        "log_level": "warning",
    }


def test_a_flag_given_twice_and_flags_miles_sets_are_refused():
    errors = _errors(["--sglang-enable-metrics", "--sglang-enable-metrics", "false"])
    assert errors == ["--sglang-enable-metrics: given twice"]
    errors = _errors(
        ["--sglang-port", "1", "--sglang-model", "/x", "--sglang-tensor-parallel-size", "2", "--sglang-admin-api-key",
         "k", "--sglang-config", "s.yaml"]
    )  # fmt: skip
    assert errors == [
        "--sglang-port='1': cannot be passed through: it is picked by miles for each engine (a free port, told to "
        "the router and the trainers)",
        "--sglang-model='/x': cannot be passed through: it is --hf-checkpoint (every engine starts on the "
        "policy's weights)",
        "--sglang-tensor-parallel-size='2': cannot be passed through: it is --rollout-num-gpus-per-engine (the GPUs "
        "miles places for each engine)",
        "--sglang-admin-api-key='k': cannot be passed through: it is --engine-api-key: the engines' keys go by "
        "environment, never on a command line (any local user can read it)",
        "--sglang-config='s.yaml': cannot be passed through: it would read SGLang options from a YAML file past "
        "these checks: pass each as --sglang-NAME VALUE",
    ]


# ---------------------------------------------------------------------------------------- launching


def test_the_command_line_keeps_switches_bare_and_values_in_their_token():
    assert flag_args({"enable_metrics": "", "enable-x": True, "off": False, "none": None, "seed": "-1"}) == [
        "--enable-metrics",
        "--enable-x",
        "--seed=-1",
    ]
    cmd = EngineProcess("/m", kind="sglang", port=7, tp_size=2, sglang_args=_sglang("--sglang-enable-metrics",
                        "--sglang-dllm-fdfo", "false", "--sglang-cuda-graph-bs-decode", "1", "2")).command()  # fmt: skip
    assert cmd[3:] == [
        "--model-path=/m", "--host=127.0.0.1", "--port=7", "--tp-size=2", "--enable-metrics", "--dllm-fdfo=false",
        "--cuda-graph-bs-decode=1 2",
    ]  # fmt: skip


def test_sglang_form_reads_each_flag_as_its_parser_declares_it():
    p = _fake_sglang_parser()
    argv = [
        "--model-path=/m", "--enable-metrics", "--enable-hicache=false", "--dllm-fdfo=false",
        "--cuda-graph-bs-decode=1 2 4", "--lora-paths=a=/p '{\"lora_name\": \"n x\"}'", "--model-checksum",
        "--json-model-override-args={\"a\": 1}", "--tp-size=-3",
    ]  # fmt: skip
    out = sglang_form(argv, p)
    assert out == [
        "--model-path=/m", "--enable-metrics",  # bare stays bare
        # a plain switch off: left out (SGLang's default), never its alias
        "--no-dllm-fdfo",  # a switch with both forms off: its --no- form
        "--cuda-graph-bs-decode", "1", "2", "4", "--lora-paths", "a=/p", '{"lora_name": "n x"}', "--model-checksum",
        '--json-model-override-args={"a": 1}', "--tp-size=-3",
    ]  # fmt: skip
    ns = p.parse_args(out)
    assert (ns.enable_metrics, ns.enable_hierarchical_cache, ns.dllm_fdfo) == (True, False, False)
    assert ns.cuda_graph_bs_decode == [1, 2, 4] and ns.lora_paths == ["a=/p", '{"lora_name": "n x"}']
    assert (ns.model_checksum, ns.json_model_override_args, ns.tp_size) == ("auto", '{"a": 1}', -3)
    on = sglang_form(
        ["--model-path=/m", "--enable-metrics=TRUE", "--dllm-fdfo=true", "--no-dllm-fdfo=false"], p
    )
    assert on == ["--model-path=/m", "--enable-metrics", "--dllm-fdfo", "--dllm-fdfo"]
    assert sglang_form(["--enable-metrics=maybe"], p) == [
        "--enable-metrics=maybe"
    ]  # SGLang's parser says why


def test_keys_travel_as_one_token_even_when_they_start_with_a_dash():
    argv = argv_with_keys(["--model-path=/m"], {ADMIN_API_KEY_ENV: "-k3y"})
    assert argv == ["--model-path=/m", "--admin-api-key=-k3y"]
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--model-path")
    p.add_argument("--admin-api-key")
    assert p.parse_args(argv).admin_api_key == "-k3y"
    with pytest.raises(argparse.ArgumentError, match="expected one argument"):  # the two-token form
        p.parse_args(["--admin-api-key", "-k3y"])


# ---------------------------------------------------------------------------------------- validation


@pytest.fixture
def fake_sglang(monkeypatch):
    """Validation as where SGLang is installed, with a parser of SGLang's shapes."""
    monkeypatch.setattr(sglang_args, "sglang_installed", lambda: True)
    monkeypatch.setattr(sglang_args, "sglang_parser", _fake_sglang_parser)


def test_validation_runs_sglang_parser_on_each_flag_naming_ours(fake_sglang):
    errors = _errors(
        ["--sglang-attention-backend", "nope", "--sglang-enable-metric", "--sglang-enable-metrics", "maybe",
         "--sglang-cuda-graph-bs-decode", "1", "x", "--sglang-json-model-override-args", "--sglang-enable-hicache",
         "false"]
    )  # fmt: skip
    assert errors == [
        "--sglang-enable-metric: SGLang has no such option (did you mean '--sglang-enable-metrics'?)",
        "--sglang-enable-metrics='maybe': is a switch: give it no value, true or false",
        "--sglang-cuda-graph-bs-decode='1 x': SGLang refuses it: argument --cuda-graph-bs-decode: invalid int "
        "value: 'x'",
        "--sglang-json-model-override-args: SGLang refuses it: argument --json-model-override-args: expected one "
        "argument",
        "--sglang-attention-backend='nope': SGLang refuses it: argument --attention-backend: invalid choice: "
        "'nope' (choose from 'fa3', 'triton')",
    ]
    ok = ["--sglang-attention-backend", "fa3", "--sglang-dllm-fdfo", "false", "--sglang-model-checksum"]
    assert _sglang(*ok)["dllm_fdfo"] == "false"
    # engines miles does not launch with these flags: not checked
    assert (
        _sglang("--sglang-attention-backend", "nope", "--rollout-engine", "local")["attention_backend"]
        == "nope"
    )


def test_config_rebuilt_in_the_actors_does_not_run_sglang_parser(fake_sglang, monkeypatch):
    cfg = parse_config(MINIMAL + ["--sglang-attention-backend", "fa3"])
    monkeypatch.setattr(
        sglang_args, "sglang_parser", lambda: pytest.fail("SGLang imported by Config.from_dict")
    )
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------------------- seeds


def test_sglang_seeds_requests_only_with_deterministic_inference():
    assert not sglang_seeds_requests({})
    assert not sglang_seeds_requests({"enable_deterministic_inference": "false"})
    for on in ("", "true", True):
        assert sglang_seeds_requests({"enable_deterministic_inference": on})
    assert sglang_seeds_requests({"enable-deterministic-inference": ""})
    assert sglang_seeds_requests({"rl_on_policy_target": "fsdp"})


def test_launch_warns_once_that_sglang_ignores_request_seeds(caplog):
    with caplog.at_level(logging.WARNING, logger="miles.engines.sglang_engine"):
        for i in range(3):
            engine_launch_kwargs("sglang", i, 42, colocate=False)
        engine_launch_kwargs("local", 0, 42, colocate=False)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "not reproducible from --rollout-seed 42" in warnings[0]
    assert "--sglang-enable-deterministic-inference" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles.engines.sglang_engine"):
        args = _sglang("--sglang-enable-deterministic-inference")
        launch = engine_launch_kwargs("sglang", 0, 42, colocate=True, sglang_args=args)
    assert not caplog.records
    assert launch["sglang_args"] == {
        "enable_deterministic_inference": "",
        "random_seed": "42",
        "enable_memory_saver": True,
    }
