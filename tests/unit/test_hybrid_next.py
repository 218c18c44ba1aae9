"""Tiny Qwen3-Next (linear attention + full attention + MoE) in the trainer: packed = per-sample (log-probs,
grads, fp32) because every linear-attention layer restarts its state at the pack's sequence boundaries (and
without that the pack leaks state from one sequence into the next), MoE routing capture, replay and losses on its
routers, and the kernels extra's message."""

from __future__ import annotations

import copy

import pytest
import torch

import miles.backends.fsdp_utils.packed_attention as packed_attention
from miles.algo.logprobs import compute_log_probs
from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.forward import forward_packed
from miles.backends.fsdp_utils.linear_attention import (
    has_linear_attention,
    linear_attention_kernels,
    linear_attention_layers,
)
from miles.backends.fsdp_utils.moe import MoETraining, moe_routers, moe_routing, pack_replay
from miles.tools.tiny_next import tiny_next_config, tiny_next_model

TEMPERATURE = 0.8
VOCAB = 64
# one sequence past the delta rule's 64-token chunk, so chunk boundaries fall inside a sequence too
SHAPES = [(5, 7), (2, 1), (60, 12), (3, 4)]


def model_and_samples(seed: int = 0):
    config = tiny_next_config(VOCAB, hidden_size=32, num_layers=2, num_experts=4, top_k=2)
    model = tiny_next_model(config, seed)
    model.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(1)
    samples = [
        {"tokens": torch.randint(1, VOCAB, (p + r,), generator=g).tolist(), "response_length": r}
        for p, r in SHAPES
    ]
    return model, samples


def per_sample_log_probs(model, samples, grad: bool = False):
    out = []
    for s in samples:
        ids = torch.tensor(s["tokens"])
        n, p = len(ids), len(ids) - s["response_length"]
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
        out.append(compute_log_probs(logits[p - 1 : n - 1], ids[p:], TEMPERATURE))
    return out


def packed_log_probs(model, samples, replay_from=None):
    out = {}
    for pack in pack_sequences(samples, num_packs=1):
        order = pack.sample_indices.tolist()
        assert len(order) == len(samples)  # one pack of all: the boundaries matter
        replay = None
        if replay_from is not None:
            lengths = [len(samples[i]["tokens"]) for i in order]
            replay = pack_replay([replay_from[i] for i in order], lengths, 2, 2)
        with moe_routing(model, replay):
            lps, _ = forward_packed(model, pack, TEMPERATURE)
        out.update(zip(order, lps))
    return [out[i] for i in range(len(samples))]


def test_tiny_next_is_hybrid_moe():
    model, _ = model_and_samples()
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    assert has_linear_attention(model) and has_linear_attention(model.config)
    assert len(linear_attention_layers(model)) == 1 and len(moe_routers(model)) == 2


def test_packed_equals_per_sample_log_probs_and_grads():
    model, samples = model_and_samples()
    ref = copy.deepcopy(model)
    ref_lps = per_sample_log_probs(ref, samples, grad=True)
    sum((lp * (k + 1)).sum() for k, lp in enumerate(ref_lps)).backward()
    got = packed_log_probs(model, samples)
    sum((lp * (k + 1)).sum() for k, lp in enumerate(got)).backward()
    for a, b in zip(got, ref_lps):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    assert model.model.layers[0].linear_attn.A_log.grad.abs().sum() > 0


def test_without_the_reset_the_pack_leaks_state_across_sequences(monkeypatch):
    model, samples = model_and_samples()
    layer = linear_attention_layers(model)[0]
    h = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = layer(h[:, 8:])
        carried = layer(h)[:, 8:]  # one row, no boundaries: the second sequence starts from the first's state
    assert float((carried - alone).abs().max()) > 1e-3
    # and transformers' torch fallback refuses boundaries it cannot honour: the per-sequence run is what packs
    monkeypatch.setattr(packed_attention, "segment_linear_attention", lambda m: 0)
    with pytest.raises(ValueError, match="packed sequences apart"):
        packed_log_probs(model, samples)


def test_moe_routing_replay_and_losses_on_next_routers():
    model, samples = model_and_samples()
    own = []
    for s in samples:
        with torch.no_grad(), moe_routing(model) as cap:
            model(input_ids=torch.tensor([s["tokens"]]), use_cache=False)
        own.append(cap.stacked_experts()[:-1].reshape(len(s["tokens"]) - 1, -1).numpy())
    plain = packed_log_probs(model, samples)
    replayed = packed_log_probs(model, samples, replay_from=own)
    for a, b in zip(plain, replayed):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    moe = MoETraining(model, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    assert (moe.num_experts, moe.top_k) == (4, 2)
    pack = pack_sequences(samples, num_packs=1)[0]
    with moe.forward([s["tokens"] for s in samples], pack.sample_indices.tolist()) as cap:
        forward_packed(model, pack, TEMPERATURE)
    loss, metrics = moe.loss(cap, num_micro_batches=1)
    loss.backward()
    assert metrics["moe/load_max_over_mean"] >= 1.0 and metrics["moe/aux_loss"] > 0
    assert all(r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_kernels_extra_message(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert linear_attention_kernels() == ["flash-linear-attention", "causal-conv1d"]
    with pytest.raises(ImportError, match=r"miles\[hybrid\]"):
        linear_attention_kernels(required=True)
