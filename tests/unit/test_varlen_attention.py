"""Packed varlen attention and forward_packed against per-sequence forwards of a tiny random Qwen3 (fp32)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import Qwen3ForCausalLM

from miles.algo.logprobs import compute_entropy, compute_log_probs
from miles.backends.fsdp_utils.attention import set_varlen_backend
from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.forward import forward_packed
from miles.backends.fsdp_utils.packed_attention import (
    PAD_WORK_LIMIT,
    VARLEN_ATTENTION,
    cu_seqlens_from_position_ids,
    length_buckets,
    padded_layout,
    varlen_attention_forward,
)
from tests.tiny_models import tiny_qwen3

TEMPERATURE = 0.7


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    model = tiny_qwen3(seed, vocab_size=96, max_position_embeddings=256)
    model.set_attn_implementation("sdpa")
    return model


def samples_with_zero_tokens() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for prompt_len, resp_len in [(5, 7), (2, 1), (9, 12), (1, 4), (3, 3)]:
        tokens = torch.randint(1, 96, (prompt_len + resp_len,), generator=g).tolist()
        out.append({"tokens": tokens, "response_length": resp_len})
    out[0]["tokens"][-2:] = [0, 0]  # response ends in token id 0
    out[2]["tokens"] = [0] * len(out[2]["tokens"])  # sequence made only of id 0
    return out


def reference(model, samples, temperature):
    """Each sequence alone, HF's own sdpa attention: per-response-token log-probs and entropy."""
    lps, ents = [], []
    for s in samples:
        ids = torch.tensor(s["tokens"])
        p = len(ids) - s["response_length"]
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        rows = logits[p - 1 : len(ids) - 1]
        lps.append(compute_log_probs(rows, ids[p:], temperature))
        ents.append(compute_entropy(rows, temperature))
    return lps, ents


def _loss(lps, ents):
    return sum((lp * (k + 1)).sum() for k, lp in enumerate(lps)) + 0.3 * sum(e.sum() for e in ents)


@pytest.mark.parametrize("num_packs", [1, 2])
def test_packed_equals_per_sequence(num_packs):
    ref_model = tiny_model()
    model = copy.deepcopy(ref_model)
    samples = samples_with_zero_tokens()
    packs = pack_sequences(samples, num_packs=num_packs)
    assert model.config._attn_implementation == "sdpa"

    ref_lp, ref_ent = reference(ref_model, samples, TEMPERATURE)
    _loss(ref_lp, ref_ent).backward()

    got_lp: dict[int, torch.Tensor] = {}
    got_ent: dict[int, torch.Tensor] = {}
    for p in packs:
        lps, ents = forward_packed(model, p, TEMPERATURE, with_entropy=True)
        for idx, lp, ent in zip(p.sample_indices.tolist(), lps, ents):
            got_lp[idx], got_ent[idx] = lp, ent
    assert model.config._attn_implementation == VARLEN_ATTENTION
    for i, s in enumerate(samples):
        assert got_lp[i].shape == (s["response_length"],)
        torch.testing.assert_close(got_lp[i], ref_lp[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(got_ent[i], ref_ent[i], atol=1e-5, rtol=0)
    _loss([got_lp[i] for i in range(len(samples))], [got_ent[i] for i in range(len(samples))]).backward()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_no_cross_sequence_leak():
    model = tiny_model()
    samples = samples_with_zero_tokens()
    (p,) = pack_sequences(samples, num_packs=1)
    base, _ = forward_packed(model, p, 1.0)
    perturbed = [dict(s) for s in samples]
    perturbed[1] = {
        "tokens": [7] * len(samples[1]["tokens"]),
        "response_length": samples[1]["response_length"],
    }
    perturbed[3] = {"tokens": [(t + 5) % 96 for t in samples[3]["tokens"]], "response_length": 4}
    (q,) = pack_sequences(perturbed, num_packs=1)
    after, _ = forward_packed(model, q, 1.0)
    for i in (0, 2, 4):
        torch.testing.assert_close(after[i], base[i], atol=1e-6, rtol=0)
    assert not torch.allclose(after[3], base[3])


def _loop_attention(q, k, v, bounds, scale):
    """Plain-loop reference: q [H, T, D], k/v [Hkv, T, D] -> [T, H, D]."""
    h, t, d = q.shape
    rep = h // k.shape[0]
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for s, e in zip(bounds[:-1], bounds[1:]):
        for i in range(s, e):
            for head in range(h):
                kh = k[head // rep]
                vh = v[head // rep]
                scores = [float(q[head, i] @ kh[j]) * scale for j in range(s, i + 1)]
                m = max(scores)
                w = [math.exp(x - m) for x in scores]
                z = sum(w)
                for j, wj in zip(range(s, i + 1), w):
                    out[i, head] += (wj / z) * vh[j].double()
    return out.float()


def test_attention_function_matches_loop_reference():
    torch.manual_seed(0)
    bounds = [0, 3, 4, 9, 13]
    q = torch.randn(1, 4, 13, 8)
    k = torch.randn(1, 2, 13, 8)
    v = torch.randn(1, 2, 13, 8)
    module = torch.nn.Module()
    want = _loop_attention(q[0], k[0], v[0], bounds, 0.3)
    cu = torch.tensor(bounds, dtype=torch.int32)
    got, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=0)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    assert cu_seqlens_from_position_ids(pos).tolist() == bounds
    got_pos, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, position_ids=pos)
    torch.testing.assert_close(got_pos, got, atol=0, rtol=0)
    # the layout forward_packed builds once per pack gives every layer the same numbers as building it there
    layout = padded_layout(bounds, "cpu")
    got_layout, _ = varlen_attention_forward(
        module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, miles_layout=layout
    )
    torch.testing.assert_close(got_layout, got, atol=0, rtol=0)
    with pytest.raises(ValueError, match="miles_layout was built for sequence boundaries"):
        other = padded_layout([0, 4, 4, 9, 13], "cpu")
        varlen_attention_forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, miles_layout=other)


@pytest.mark.parametrize(
    "lengths",
    [[5], [4, 4, 4], [30, 1, 0, 7, 12, 29, 2, 0, 16], [3, 40, 3, 3, 3, 3, 3, 3]],
)
def test_length_buckets_cover_every_sequence_within_the_padding_limit(lengths):
    buckets = length_buckets(lengths)
    flat = sorted(i for b in buckets for i in b)
    assert flat == [
        i for i, n in enumerate(lengths) if n > 0
    ]  # each non-empty sequence once, empties left out
    for b in buckets:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest
        assert len(b) * longest**2 <= PAD_WORK_LIMIT * sum(lengths[i] ** 2 for i in b)


@pytest.mark.parametrize("bounds", [[0, 3, 4, 9, 13], [0, 6, 6, 12, 13, 19], [0, 1], [0, 2, 17, 18, 19, 33]])
def test_bucketed_attention_matches_loop_reference_with_gradients(bounds):
    """Sequences of mixed lengths (padded into buckets, one empty) against the plain loop, and the gradients
    against per-sequence SDPA calls; two rows sharing the boundaries (B = 2) as well."""
    torch.manual_seed(1)
    t = bounds[-1]
    q = torch.randn(2, 4, t, 8, requires_grad=True)
    k = torch.randn(2, 2, t, 8, requires_grad=True)
    v = torch.randn(2, 2, t, 8, requires_grad=True)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])]).repeat(2, 1)
    got, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3, position_ids=pos)
    for row in range(2):
        want = _loop_attention(q[row].detach(), k[row].detach(), v[row].detach(), bounds, 0.3)
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=0)
    weights = torch.randn_like(got)
    (got * weights).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=0.3, enable_gqa=True
            )
            for s, e in zip(bounds[:-1], bounds[1:])
            if e > s
        ],
        dim=2,
    ).transpose(1, 2)
    (ref * weights).sum().backward()
    for g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, x.grad, atol=1e-5, rtol=1e-5)


def test_attention_errors():
    q = torch.randn(1, 2, 4, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="not an attention_mask"):
        varlen_attention_forward(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        varlen_attention_forward(module, q, q, q, None, sliding_window=2)
    with pytest.raises(ValueError, match="cu_seqlens ends at 5 but the packed row has 4 tokens"):
        varlen_attention_forward(module, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="not one of"):
        set_varlen_backend("triton")
    set_varlen_backend("flash")
    try:
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            varlen_attention_forward(module, q, q, q, None)
    finally:
        set_varlen_backend("auto")


def test_flash_import_error_names_gpu_extra(monkeypatch):
    pytest.importorskip("torch")
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed")
    except ImportError:
        pass
    from miles.backends.fsdp_utils import attention

    monkeypatch.setattr(attention, "torch_varlen_func", lambda: None)  # a torch without its own varlen kernel
    with pytest.raises(ImportError, match=r"miles\[gpu\]"):
        attention._import_flash_varlen()


@pytest.mark.parametrize("style", ["window_size", "is_causal"])
def test_torch_varlen_adapter_passes_what_the_installed_signature_takes(monkeypatch, style):
    """miles_varlen without flash-attn on CUDA calls torch.nn.attention.varlen.varlen_attn through an adapter of
    the varlen-kernel shape (causal); torch releases spell causality differently (window_size=(-1, 0) or
    is_causal). flash_attention_2 named does not fall back: FA2 named means FA2 run."""
    import sys
    import types

    from miles.backends.fsdp_utils import attention

    calls = []
    if style == "window_size":

        def varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
        ):
            calls.append({"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
            return q
    else:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
            calls.append({"scale": scale, "is_causal": is_causal})
            return q

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    monkeypatch.setitem(
        sys.modules, "torch.nn.attention.varlen", types.SimpleNamespace(varlen_attn=varlen_attn)
    )
    monkeypatch.setattr(attention, "_backend", "auto")
    assert not attention.flash_attn_installed()
    fn = attention._import_flash_varlen()
    q, kv = torch.zeros(6, 4, 8), torch.zeros(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert fn(q, kv, kv, cu, cu, 4, 4, 0.0, 0.5) is q
    if style == "window_size":
        assert calls == [{"scale": 0.5, "window_size": (-1, 0), "enable_gqa": True}]
    else:
        assert calls == [{"scale": 0.5, "is_causal": True}]
    with pytest.raises(ValueError, match="dropout"):
        fn(q, kv, kv, cu, cu, 4, 4, 0.1, None)
    monkeypatch.setattr(attention, "_backend", "flash")
    with pytest.raises(ImportError, match="FlashAttention-2"):
        attention._import_flash_varlen()


def test_forward_packed_rejects_empty_pack():
    from miles.backends.fsdp_utils.data_packing import _build_pack

    with pytest.raises(ValueError, match="empty pack"):
        forward_packed(tiny_model(), _build_pack([], []), 1.0)


def test_padding_mask_and_kv_cache_are_refused():
    model = tiny_model()
    (p,) = pack_sequences(samples_with_zero_tokens()[:2], num_packs=1)
    forward_packed(model, p, 1.0)  # switches the model to miles_varlen
    ids = torch.randint(1, 96, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    ref = tiny_model()
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
        ref(input_ids=ids, attention_mask=mask, use_cache=False).logits,
        atol=1e-5,
        rtol=0,
    )
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="does not apply padding masks"):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    out = model(input_ids=ids[:1, :4], use_cache=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids[:1, 4:], past_key_values=out.past_key_values, use_cache=True)


def _fake_module(monkeypatch, name: str, calls: list, result):
    import sys
    import types

    module = types.ModuleType(name)

    def flash_attn_varlen_func(*args, **kwargs):
        calls.append((name, args, kwargs))
        return result

    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize(
    ("attn", "module", "returns_tuple"),
    [
        ("flash_attention_2", "flash_attn", False),
        ("flash_attention_3", "flash_attn_interface", False),
        ("flash_attention_3", "flash_attn_interface", True),  # FA3 betas return (out, softmax_lse)
    ],
)
def test_each_flash_name_runs_its_own_kernel(monkeypatch, attn, module, returns_tuple):
    """flash_attention_2 calls flash_attn's varlen kernel, flash_attention_3 flash_attn_interface's (FA3), with
    causal=True and the scale; the other package is never touched."""
    from miles.backends.fsdp_utils import attention

    calls: list = []
    out = torch.ones(3, 2, 4)
    _fake_module(monkeypatch, module, calls, (out, torch.zeros(2, 3)) if returns_tuple else out)
    other = "flash_attn_interface" if module == "flash_attn" else "flash_attn"
    monkeypatch.setitem(__import__("sys").modules, other, None)  # importing the other one would fail
    try:
        attention.select_attention_kernel(attn, is_cuda=True)  # imports the kernel now, at model build
        assert attention.varlen_backend() == ("flash" if attn == "flash_attention_2" else "flash3")
        kernel = attention._import_flash_varlen()
        q = torch.zeros(3, 2, 4)
        cu = torch.tensor([0, 3], dtype=torch.int32)
        assert kernel(q, q, q, cu, cu, 3, 3, 0.0, 0.5) is out
    finally:
        set_varlen_backend("auto")
    assert [c[0] for c in calls] == [module]
    assert calls[0][2]["causal"] is True and calls[0][2]["softmax_scale"] == 0.5


def test_missing_flash_package_is_named_at_model_build(monkeypatch):
    import sys

    from miles.backends.fsdp_utils import attention
    from miles.backends.fsdp_utils.attention import select_attention_kernel

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    try:
        with pytest.raises(ImportError, match=r"FlashAttention-3 \(module flash_attn_interface\).*hopper"):
            select_attention_kernel("flash_attention_3", is_cuda=True)
        with pytest.raises(ImportError, match=r"flash_attn.*miles\[gpu\]"):
            select_attention_kernel("flash_attention_2", is_cuda=True)
        # miles_varlen on CUDA: FA2, else torch's own varlen kernel, else the error naming the extra
        select_attention_kernel("miles_varlen", is_cuda=True)
        monkeypatch.setattr(attention, "torch_varlen_func", lambda: None)
        with pytest.raises(ImportError, match=r"flash_attn.*miles\[gpu\]"):
            select_attention_kernel("miles_varlen", is_cuda=True)
        select_attention_kernel("miles_varlen", is_cuda=False)  # SDPA on CPU: nothing to import
        with pytest.raises(ValueError, match="needs a CUDA device"):
            select_attention_kernel("flash_attention_2", is_cuda=False)
        with pytest.raises(ValueError, match="flash_attention_3 has no context-parallel kernel"):
            select_attention_kernel("flash_attention_3", is_cuda=True, cp_size=2)
    finally:
        set_varlen_backend("auto")


def test_fa2_with_context_parallel_needs_ring_flash_attn_at_model_build(monkeypatch):
    import importlib.util
    import sys

    from miles.backends.fsdp_utils.attention import select_attention_kernel

    _fake_module(monkeypatch, "flash_attn", [], None)
    monkeypatch.delitem(sys.modules, "_miles_ring_flash_attn.llama3_flash_attn_varlen", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "ring_flash_attn" else real_find_spec(n, *a)
    )
    try:
        select_attention_kernel("flash_attention_2", is_cuda=True, cp_size=1)
        with pytest.raises(ImportError, match="runs ring-flash-attn"):
            select_attention_kernel("flash_attention_2", is_cuda=True, cp_size=2)
        select_attention_kernel("sdpa", is_cuda=True, cp_size=2)  # plain-torch all-gather: no ring needed
    finally:
        set_varlen_backend("auto")


def test_cp_without_flash_attn_uses_the_all_gather_on_cuda(monkeypatch):
    """miles_varlen on CUDA without flash-attn runs torch's varlen kernel, which ring-flash-attn cannot call: CP
    attention then takes the plain-torch all-gather; with flash-attn installed, the ring."""
    import sys

    from miles.backends.fsdp_utils import attention, context_parallel

    cuda_query = torch.zeros(1, 1, 1, 1)
    monkeypatch.setattr(context_parallel, "use_flash_kernel", lambda q: True)  # as for a CUDA query
    monkeypatch.setattr(attention, "_backend", "auto")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert not context_parallel._use_ring(cuda_query)
    monkeypatch.setitem(sys.modules, "flash_attn", object())
    assert context_parallel._use_ring(cuda_query)
    monkeypatch.setattr(attention, "_backend", "flash")  # flash_attention_2 named: the ring, always
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert context_parallel._use_ring(cuda_query)


def test_boundaries_end_checked_once_per_tensor_and_again_after_a_change():
    """Every layer of a forward gets the same cu_seqlens tensor: its end is checked once (a device sync on CUDA),
    and again when the tensor is a new one or was changed in place."""
    from miles.backends.fsdp_utils import packed_attention

    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    packed_attention._check_cu_end(cu, 5)
    packed_attention._check_cu_end(cu, 5)
    cu[-1] = 6  # in place: version bumps, checked again
    with pytest.raises(ValueError, match="cu_seqlens ends at 6 but the packed row has 5 tokens"):
        packed_attention._check_cu_end(cu, 5)
    with pytest.raises(ValueError, match="ends at 4"):
        packed_attention._check_cu_end(torch.tensor([0, 4], dtype=torch.int32), 5)
