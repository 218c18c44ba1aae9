"""Packed forwards on CUDA: SDPA per sequence in fp32, and flash-attn varlen in bf16 when it is installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miles.algo.logprobs import compute_log_probs
from miles.backends.fsdp_utils.attention import set_varlen_backend
from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.forward import forward_packed


def _model(dtype: torch.dtype):
    from miles.tools.tiny_model import tiny_config, tiny_model

    # hidden 64, head_dim 16
    config = tiny_config(128, max_position_embeddings=256, tie_word_embeddings=False)
    return tiny_model(config, seed=0).to("cuda", dtype).eval()


def _samples() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n, r in [(5, 7), (3, 1), (9, 12), (2, 4)]:
        out.append({"tokens": torch.randint(0, 128, (n + r,), generator=g).tolist(), "response_length": r})
    return out


def _per_sequence(model, samples, temperature):
    ref = []
    for s in samples:
        ids = torch.tensor([s["tokens"]], device="cuda")
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0]
        p = len(s["tokens"]) - s["response_length"]
        ref.append(compute_log_probs(logits[p - 1 : -1], ids[0, p:], temperature))
    return ref


def _check_packed(model, temperature: float, backend: str, atol: float) -> None:
    """Packed forward with the varlen `backend` against per-sequence forwards of the same model."""
    samples = _samples()
    ref = _per_sequence(model, samples, temperature)
    set_varlen_backend(backend)
    try:
        (packed,) = pack_sequences(samples, num_packs=1)
        with torch.no_grad():
            lps, _ = forward_packed(model, packed, temperature)
    finally:
        set_varlen_backend("auto")
    for i, lp in zip(packed.sample_indices.tolist(), lps):
        torch.testing.assert_close(lp, ref[i], atol=atol, rtol=0)


def test_sdpa_packed_equals_per_sequence_fp32():
    _check_packed(_model(torch.float32), 0.7, "sdpa", atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed")
def test_flash_varlen_packed_matches_per_sequence_bf16():
    _check_packed(_model(torch.bfloat16), 1.0, "flash", atol=5e-2)  # bf16 kernels differ in rounding
