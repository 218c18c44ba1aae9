"""The embedded engine's routed experts (SGLang's return_routed_experts) on a tiny Qwen3-MoE: the layout, the same
experts the trainer's own routing picks over the same weights, SGLang's behaviour without the server flag, and the
test aid that routes some positions off the top-k (the trainer matches it only by replaying)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.algo.logprobs import compute_log_probs
from miles.backends.fsdp_utils.moe import moe_routing
from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.engines.local.routing_capture import routing_hooks
from miles.tools.tiny_model import build_word_model
from miles.tools.tiny_moe import build_tiny_moe
from miles.utils.routed_experts import decode_routed_experts

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
SP = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(build_tiny_moe(tmp_path_factory.mktemp("moe") / "m", hidden_size=32, initializer_range=0.2))


def _engine(path: str, **kw) -> LocalEngine:
    # the KV-cache runner serves MoE; its decode kernel compiles in a subprocess (not in tests/unit)
    eng = LocalEngine(
        LocalEngineConfig(model_path=path, max_running_requests=4, cpu_decode_kernel=False, **kw)
    )
    eng.start()
    return eng


def _generate(eng: LocalEngine, routed: bool = True) -> list[dict]:
    body = {
        "input_ids": PROMPTS,
        "sampling_params": SP,
        "return_logprob": True,
        "return_routed_experts": routed,
    }
    _, futs, _ = eng.submit_generate(body)
    return [f.result(60) for f in futs]


def _trainer_view(eng: LocalEngine, tokens: list[int], replay: np.ndarray | None = None):
    """The HF model's own forward over the whole sequence (the trainer's): experts per position and the
    log-probs of the last len(tokens) - prompt tokens; with `replay` those experts replace its top-k."""
    model = eng.model
    ids = torch.tensor([tokens])
    rep = None
    if replay is not None:
        rep = torch.full((len(tokens), 2, 2), -1, dtype=torch.long)
        rep[: len(replay)] = torch.as_tensor(replay.reshape(len(replay), 2, 2)).long()
    hooks = routing_hooks(eng.runner)
    assert hooks is not None
    every, hooks.off_top_k_every = (
        hooks.off_top_k_every,
        0,
    )  # the engine's test aid off: the trainer's routing
    try:
        with torch.no_grad(), moe_routing(model, rep) as cap:
            logits = model(input_ids=ids, use_cache=False).logits[0]
    finally:
        hooks.off_top_k_every = every
    return cap.stacked_experts().numpy(), logits


def test_engine_routes_as_the_trainer_and_returns_sglang_layout(moe_dir):
    eng = _engine(moe_dir, enable_return_routed_experts=True)
    try:
        outs = _generate(eng)
        for prompt, out in zip(PROMPTS, outs):
            tokens = prompt + out["output_ids"]
            routed = decode_routed_experts(out["meta_info"]["routed_experts"], len(tokens) - 1)
            assert routed.shape == (len(tokens) - 1, 2 * 2)  # [seqlen - 1, layers * top_k]
            own, _ = _trainer_view(eng, tokens)
            assert (routed == own[:-1].reshape(len(tokens) - 1, -1)).all()
        plain = _generate(eng, routed=False)
        assert all("routed_experts" not in o["meta_info"] for o in plain)
        with pytest.raises(ValueError, match="return_routed_experts must be a bool"):
            eng.submit_generate({"input_ids": PROMPTS[0], "return_routed_experts": [True]})
    finally:
        eng.stop()


def test_without_the_server_flag_no_routed_experts(moe_dir):
    eng = _engine(moe_dir)
    try:
        assert all("routed_experts" not in o["meta_info"] for o in _generate(eng))  # SGLang: accepted, absent
    finally:
        eng.stop()


def test_dense_model_refuses_the_flag(tmp_path):
    path = str(build_word_model(tmp_path / "dense"))
    with pytest.raises(ValueError, match="no MoE routers"):
        LocalEngine(
            LocalEngineConfig(model_path=path, enable_return_routed_experts=True, cpu_decode_kernel=False)
        )


def test_off_top_k_engine_matches_the_trainer_only_with_replay(moe_dir):
    """R3 end to end with the real engine: it routes every third position off the top-k; replaying its experts
    gives the trainer its log-probs (<= 1e-5), its own top-k does not."""
    eng = _engine(moe_dir, enable_return_routed_experts=True, test_off_top_k_every=3)
    gaps_with, gaps_without, differs = [], [], 0
    try:
        for prompt, out in zip(PROMPTS, _generate(eng)):
            tokens = prompt + out["output_ids"]
            routed = decode_routed_experts(out["meta_info"]["routed_experts"], len(tokens) - 1)
            engine_lp = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
            own, plain_logits = _trainer_view(eng, tokens)
            differs += int((own[:-1].reshape(len(routed), -1) != routed).any(-1).sum())
            _, replay_logits = _trainer_view(eng, tokens, routed)
            target, p = torch.tensor(tokens[len(prompt) :]), len(prompt)
            gaps_with.append(
                float((compute_log_probs(replay_logits[p - 1 : -1], target, 1.0) - engine_lp).abs().max())
            )
            gaps_without.append(
                float((compute_log_probs(plain_logits[p - 1 : -1], target, 1.0) - engine_lp).abs().max())
            )
    finally:
        eng.stop()
    assert differs > 0
    assert max(gaps_with) <= 1e-5, gaps_with
    assert max(gaps_without) > 1e-3, gaps_without


def test_r3_launches_engines_with_the_server_flag():
    from miles.engines.local.__main__ import parse_args
    from miles.engines.sglang_args import flag_args
    from miles.engines.sglang_engine import engine_launch_kwargs

    sglang = engine_launch_kwargs("sglang", 0, 1, colocate=False, return_routed_experts=True)["sglang_args"]
    assert sglang["enable_return_routed_experts"] is True
    local = engine_launch_kwargs("local", 0, 1, colocate=False, return_routed_experts=True)["local_args"]
    assert parse_args(["--model-path", "m", *flag_args(local)]).enable_return_routed_experts
    plain = engine_launch_kwargs("local", 0, 1, colocate=False)["local_args"]
    assert not parse_args(["--model-path", "m", *flag_args(plain)]).enable_return_routed_experts
