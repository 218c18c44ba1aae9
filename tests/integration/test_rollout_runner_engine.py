"""The rollout runner against a real embedded engine process (no Ray): reproducible single-turn rollouts, and
multi-turn tool use whose model tokens' packed log-probs equal the engine's."""

from __future__ import annotations

import pytest
import torch

from miles.config import parse_config
from miles.rollout.runner import RolloutRunner
from miles.utils.types import SampleStatus


@pytest.fixture(scope="module")
def calc(tmp_path_factory):
    from examples.calculator.build import build

    return build(tmp_path_factory.mktemp("calc"), n_train=64, n_eval=4)


@pytest.fixture(scope="module")
def engine(calc):
    from miles.engines.sglang_engine import EngineProcess

    with EngineProcess(
        str(calc / "model"), kind="local", local_args={"num-threads": 1}, startup_timeout=120
    ) as eng:
        yield eng


def runner(calc, engine, extra: str) -> RolloutRunner:
    from transformers import AutoTokenizer

    cfg = parse_config(
        (
            f"--hf-checkpoint {calc}/model --prompt-data {calc}/train.jsonl --input-key prompt --label-key label "
            "--apply-chat-template --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 4 "
            "--global-batch-size 16 --colocate --rollout-temperature 0.9 " + extra
        ).split()
    )
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
    return RolloutRunner(cfg.data, cfg.rollout, cfg.eval, tok, engine.url, [engine.url], None, concurrency=16)


def test_single_turn_rollout_is_reproducible(calc, engine):
    extra = "--custom-rm-path examples.calculator.tool:calculator_reward --rollout-max-response-len 5"
    first, m1 = runner(calc, engine, extra).generate(0)
    again, m2 = runner(calc, engine, extra).generate(0)  # a fresh runner: same prompts, same request ids
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert all(s.rollout_log_probs is not None and s.loss_mask == [1] * s.response_length for s in first)
    assert m1["rollout/raw_reward"] == m2["rollout/raw_reward"]


def test_multi_turn_model_token_log_probs_equal_the_packed_forward(calc, engine):
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.data_packing import pack_sequences
    from miles.backends.fsdp_utils.forward import forward_packed

    extra = (
        "--custom-generate-function-path miles.rollout.multi_turn.generate_multi_turn "
        "--generate-execute-tool-function-path examples.calculator.tool:calculator --generate-max-turns 3 "
        "--custom-rm-path examples.calculator.tool:calculator_reward --rollout-max-response-len 24"
    )
    samples, metrics = runner(calc, engine, extra).generate(0)
    assert "rollout/tool_calls" in metrics
    with_tool = [s for s in samples if s.metadata["tool_calls"] > 0]
    assert with_tool, "no sample called the tool; the check below needs tool tokens"
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.check_consistent() is None
    model = AutoModelForCausalLM.from_pretrained(str(calc / "model"), dtype=torch.float32).eval()
    (packed,) = pack_sequences(
        [{"tokens": s.tokens, "response_length": s.response_length} for s in samples], 1
    )
    with torch.no_grad():
        log_probs, _ = forward_packed(model, packed, temperature=0.9)
    worst = 0.0
    for i, lp in zip(packed.sample_indices.tolist(), log_probs):
        s = samples[i]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        engine_lp = torch.tensor(s.rollout_log_probs)
        worst = max(worst, float((lp[mask] - engine_lp[mask]).abs().max()))
        assert bool((engine_lp[~mask] == 0.0).all())  # tool tokens carry no log-probs
    assert worst <= 1e-5, worst
