"""The embedded engine serves a tiny Qwen3-Next (linear + full attention + MoE) with the full-forward runner: its
sampled tokens' log-probs equal the trainer's packed forward over the same weights (<= 1e-5), and with
return_routed_experts the trainer replaying the engine's experts reproduces them too."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.forward import forward_packed
from miles.backends.fsdp_utils.moe import moe_routing, pack_replay
from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.engines.local.full_forward import NoCacheRunner
from miles.tools.tiny_next import build_tiny_next
from miles.utils.routed_experts import decode_routed_experts

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
SP = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return str(build_tiny_next(tmp_path_factory.mktemp("next") / "m", hidden_size=32, initializer_range=0.2))


def test_engine_log_probs_equal_the_trainers_packed_forward(next_dir):
    eng = LocalEngine(
        LocalEngineConfig(model_path=next_dir, max_running_requests=4, enable_return_routed_experts=True)
    )
    eng.start()
    try:
        assert isinstance(eng.runner, NoCacheRunner)
        _, futs, _ = eng.submit_generate(
            {
                "input_ids": PROMPTS,
                "sampling_params": SP,
                "return_logprob": True,
                "return_routed_experts": True,
            }
        )
        outs = [f.result(120) for f in futs]
        model = eng.model
    finally:
        eng.stop()
    samples, engine_lps, routed = [], [], []
    for prompt, out in zip(PROMPTS, outs):
        tokens = prompt + out["output_ids"]
        samples.append({"tokens": tokens, "response_length": len(out["output_ids"])})
        engine_lps.append(torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]))
        routed.append(decode_routed_experts(out["meta_info"]["routed_experts"], len(tokens) - 1))
    assert routed[0].shape[1] == 2 * 2  # [seqlen - 1, MoE layers * top_k]
    (pack,) = pack_sequences(samples, num_packs=1)
    order = pack.sample_indices.tolist()
    for replay in (
        None,
        pack_replay([routed[i] for i in order], [len(samples[i]["tokens"]) for i in order], 2, 2),
    ):
        with torch.no_grad(), moe_routing(model, replay):
            lps, _ = forward_packed(model, pack, SP["temperature"])
        for i, lp in zip(order, lps):
            torch.testing.assert_close(lp, engine_lps[i], atol=1e-5, rtol=0)
