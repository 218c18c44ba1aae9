"""Rollout flags: defaults, seam paths, and the cross-field rules of dynamic sampling, partial rollout,
multi-turn tools and rewards (each mistake one message naming the flag)."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_config

BASE = "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 --global-batch-size 4 --colocate"


def violations(extra: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config((BASE + " " + extra).split())
    return info.value.violations


def test_defaults_name_the_default_seams() -> None:
    cfg = parse_config(BASE.split())
    r, ev = cfg.rollout, cfg.eval
    assert r.rollout_function_path == "miles.rollout.default_rollout.generate_rollout"
    assert ev.eval_function_path == "miles.rollout.default_rollout.eval_rollout"
    assert r.custom_generate_function_path is None and r.dynamic_sampling_filter_path is None
    # unset, --over-sampling-batch-size resolves to --rollout-batch-size
    assert r.over_sampling_batch_size == r.rollout_batch_size
    assert not r.partial_rollout and not ev.skip_eval_before_train


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("--mask-offpolicy-in-partial-rollout", "--mask-offpolicy-in-partial-rollout=True: has no effect without --partial-rollout"),
        ("--generate-execute-tool-function-path my.tools:calc", "add --custom-generate-function-path miles.rollout.multi_turn.generate_multi_turn"),
        ("--rm-type dapo", "--rm-type='dapo': dapo rewards are dicts {score, acc}: add --reward-key score"),
        ("--rm-type remote_rm", "--rm-type='remote_rm': remote_rm needs --rm-url"),
        ("--rm-url localhost:8000", "--rm-url='localhost:8000': expected an http(s):// URL"),
        ("--group-rm --rm-type math", "--group-rm=True: calls --custom-rm-path once per prompt group"),
        ("--eval-top-k 0", "--eval-top-k=0: must be -1 (disabled) or >= 1"),
        ("--eval-top-p 0", "--eval-top-p=0.0: must be > 0"),
        ("--over-sampling-batch-size 0", "--over-sampling-batch-size=0: must be >= 1"),
        ("--dynamic-sampling-filter-path not-a-path", "--dynamic-sampling-filter-path='not-a-path': expected 'module.path:function'"),
        ("--rollout-function-path x", "--rollout-function-path='x': expected 'module.path:function'"),
        ("--rm-max-retries -1", "--rm-max-retries=-1: must be >= 0"),
        ("--generate-max-turns 0", "--generate-max-turns=0: must be >= 1"),
    ],
)  # fmt: skip
def test_rollout_rules(extra: str, expected: str) -> None:
    found = violations(extra)
    assert len(found) == 1 and expected in found[0], found


def test_valid_combinations_parse() -> None:
    cfg = parse_config(
        (
            BASE + " --partial-rollout --mask-offpolicy-in-partial-rollout --over-sampling-batch-size 8 "
            "--dynamic-sampling-filter-path miles.rollout.filter_hub.check_reward_nonzero_std "
            "--rm-type dapo --reward-key score --rm-url http://127.0.0.1:8001/reward "
            "--custom-generate-function-path miles.rollout.multi_turn.generate_multi_turn "
            "--generate-execute-tool-function-path examples.calculator.tool:calculator --eval-top-p 0.9 --eval-top-k 5"
        ).split()
    )
    assert cfg.rollout.over_sampling_batch_size == 8 and cfg.rollout.reward_key == "score"
    assert cfg.eval.eval_top_p == 0.9 and cfg.eval.eval_top_k == 5


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("--use-session-server", "--use-session-server=True: needs --agent-function-path"),
        ("--agent-function-path my.agent:run", "runs against the session server; add --use-session-server"),
        ("--use-session-server --agent-function-path agent", "--agent-function-path='agent': expected 'module.path:function'"),
        ("--use-session-server --agent-function-path a.b:run --partial-rollout", "--partial-rollout=True: is not supported with --use-session-server"),
        ("--use-session-server --agent-function-path a.b:run --custom-generate-function-path a.b:gen", "is not supported with --use-session-server: the session server is the generate function"),
    ],
)  # fmt: skip
def test_session_server_rules(extra: str, expected: str) -> None:
    assert any(expected in v for v in violations(extra)), violations(extra)


def test_session_server_runs_with_fault_tolerance() -> None:
    # a turn on an engine that dies is re-sent to another (tests/integration/test_session_engine_death.py)
    cfg = parse_config(
        (BASE + " --use-session-server --agent-function-path a.b:run --use-fault-tolerance").split()
    )
    assert cfg.rollout.use_session_server and cfg.cluster.use_fault_tolerance


def test_session_server_seams_load_the_agent_and_refuse_a_sync_one() -> None:
    from miles.rollout.seams import SESSION_GENERATE, load_seams

    cfg = parse_config(
        (BASE + " --use-session-server --agent-function-path examples.openai_agent.agent:run").split()
    )
    seams = load_seams(cfg.rollout, cfg.eval)
    assert seams.generate_name == SESSION_GENERATE and seams.agent is not None
    assert seams.agent.timeout == 600.0 and seams.agent.name == "examples.openai_agent.agent:run"
    bad = parse_config((BASE + " --use-session-server --agent-function-path json:dumps").split())
    with pytest.raises(ValueError, match="--agent-function-path='json:dumps'"):
        load_seams(bad.rollout, bad.eval)
