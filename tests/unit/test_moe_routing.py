"""Tiny Qwen3-MoE in the trainer: packed = per-sample (log-probs, grads, fp32), routing capture and replay (R3),
the router losses against a loop reference, and SGLang's routed-experts layout."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from miles.algo.logprobs import compute_log_probs
from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.forward import forward_packed
from miles.backends.fsdp_utils.moe import (
    decode_routed_experts,
    encode_routed_experts,
    moe_routers,
    moe_routing,
    pack_replay,
    router_losses,
)
from miles.tools.tiny_moe import tiny_moe_config, tiny_moe_model

TEMPERATURE = 0.8
VOCAB = 64


def model_and_samples(seed: int = 0):
    model = tiny_moe_model(tiny_moe_config(VOCAB, hidden_size=32, num_layers=2, num_experts=4, top_k=2), seed)
    model.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(1)
    samples = []
    for p, r in [(5, 7), (2, 1), (9, 12), (3, 4)]:
        samples.append(
            {"tokens": torch.randint(1, VOCAB, (p + r,), generator=g).tolist(), "response_length": r}
        )
    return model, samples


def engine_like(model, samples, perturb: bool, grad: bool = False):
    """Each sample alone, as an engine would: response log-probs and the routed experts in SGLang's layout.
    `perturb`: on every third token each layer picks its 2nd and 3rd best experts instead of the top 2 (the gate
    weights are recomputed over them the same way), the engine picking other experts than the trainer would."""
    routers = moe_routers(model)
    lps, routed = [], []
    for s in samples:
        ids = torch.tensor(s["tokens"])
        n, p = len(ids), len(ids) - s["response_length"]
        forced = None
        if perturb:
            with torch.no_grad(), moe_routing(model) as cap:
                model(input_ids=ids[None], use_cache=False)
            forced = torch.full((n, len(routers), 2), -1, dtype=torch.long)
            for layer in range(len(routers)):
                order = cap.logits[layer].argsort(dim=-1, descending=True)
                forced[::3, layer] = order[::3, 1:3]
        with torch.set_grad_enabled(grad), moe_routing(model, forced) as cap:
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
        lps.append(compute_log_probs(logits[p - 1 : n - 1], ids[p:], TEMPERATURE))
        experts = cap.stacked_experts()[: n - 1].numpy()  # SGLang: rows 0..seqlen-2
        routed.append(decode_routed_experts(encode_routed_experts(experts), n - 1))
    return lps, routed


def trainer_log_probs(model, samples, routed=None):
    out = {}
    for pack in pack_sequences(samples, num_packs=2):
        order = pack.sample_indices.tolist()
        replay = None
        if routed is not None:
            replay = pack_replay([routed[i] for i in order], [len(samples[i]["tokens"]) for i in order], 2, 2)
        with moe_routing(model, replay):
            lps, _ = forward_packed(model, pack, TEMPERATURE)
        out.update(zip(order, lps))
    return [out[i] for i in range(len(samples))]


def test_packed_equals_per_sample_log_probs_and_grads():
    model, samples = model_and_samples()
    ref = copy.deepcopy(model)
    ref_lps, _ = engine_like(ref, samples, perturb=False, grad=True)
    sum((lp * (k + 1)).sum() for k, lp in enumerate(ref_lps)).backward()
    got = trainer_log_probs(model, samples)
    sum((lp * (k + 1)).sum() for k, lp in enumerate(got)).backward()
    for a, b in zip(got, ref_lps):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_replaying_own_routing_is_bitwise_identity():
    model, samples = model_and_samples()
    _, routed = engine_like(model, samples, perturb=False)
    plain = trainer_log_probs(model, samples)
    replayed = trainer_log_probs(model, samples, routed)
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b)


def test_r3_matches_engine_when_engine_routes_differently():
    model, samples = model_and_samples()
    engine_lps, routed = engine_like(model, samples, perturb=True)
    without = trainer_log_probs(model, samples)
    with_r3 = trainer_log_probs(model, samples, routed)
    gap_without = max(float((a - b).detach().abs().max()) for a, b in zip(without, engine_lps))
    gap_with = max(float((a - b).detach().abs().max()) for a, b in zip(with_r3, engine_lps))
    assert gap_with <= 1e-5
    assert gap_without > 1e-3  # the engine's other experts move the log-probs; R3 is what removes that


def test_replay_keeps_gate_weights_differentiable():
    model, samples = model_and_samples()
    _, routed = engine_like(model, samples, perturb=True)
    sum(lp.sum() for lp in trainer_log_probs(model, samples, routed)).backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_router_losses_against_loop_reference():
    torch.manual_seed(0)
    logits = {0: torch.randn(10, 4), 1: torch.randn(10, 4)}
    experts = {k: v.topk(2, dim=-1).indices for k, v in logits.items()}
    from miles.backends.fsdp_utils.moe import RoutingCapture

    aux, z, metrics = router_losses(RoutingCapture(logits, experts), num_experts=4, top_k=2)
    ref_aux = ref_z = 0.0
    for layer in (0, 1):
        probs = torch.softmax(logits[layer], -1)
        for e in range(4):
            frac = sum(int(e in experts[layer][t].tolist()) for t in range(10)) / 10
            ref_aux += 4 / 2 * frac * float(probs[:, e].mean())
        ref_z += float(torch.stack([torch.logsumexp(r, 0) ** 2 for r in logits[layer]]).mean())
    assert float(aux) == pytest.approx(ref_aux, rel=1e-6)
    assert float(z) == pytest.approx(ref_z, rel=1e-6)
    assert metrics["moe/load_max_over_mean"] >= 1.0
    balanced = {0: torch.zeros(4, 4)}
    aux_b, _, m = router_losses(
        RoutingCapture(balanced, {0: torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])}), 4, 2
    )
    assert float(aux_b) == pytest.approx(1.0) and m["moe/load_max_over_mean"] == 1.0


def test_routed_experts_layout_round_trip_and_errors():
    experts = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    text = encode_routed_experts(experts)
    got = decode_routed_experts(text, 2)
    assert got.dtype == np.uint8 and got.shape == (2, 6) and (got.reshape(2, 3, 2) == experts).all()
    with pytest.raises(ValueError, match="multiple of 5"):
        decode_routed_experts(text, 5)
    with pytest.raises(ValueError, match="layers"):
        model, _ = model_and_samples()
        with moe_routing(model, torch.zeros(3, 5, 2, dtype=torch.long)):
            pass


def test_pack_replay_copies_a_read_only_buffer_without_warning():
    """The engine's routed experts arrive as a read-only buffer (np.frombuffer): pack_replay copies them into its
    own long tensor, with no "not writable" warning, and the caller's buffer stays untouched."""
    raw = np.arange(12, dtype=np.int32)
    ro = np.frombuffer(raw.tobytes(), dtype=np.int32).reshape(3, 4)
    assert not ro.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pack_replay([ro, None], [4, 2], 2, 2)
    assert out.dtype == torch.long and out.shape == (6, 2, 2)
    assert out[:3].reshape(3, 4).tolist() == raw.reshape(3, 4).tolist()
    assert (out[3:] == -1).all()
