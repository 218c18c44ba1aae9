"""perf/* metrics: counts, rates, FLOPs and MFU against hand computations."""

from __future__ import annotations

import pytest

from miles.utils import perf
from miles.utils.types import Sample


def test_counts_and_rates():
    samples = [Sample(tokens=[1, 2, 3, 4], response_length=2), Sample(tokens=[5, 6], response_length=1)]
    counts = perf.sample_counts(samples)
    assert counts == {"perf/samples": 2.0, "perf/generated_tokens": 3.0, "perf/trained_tokens": 6.0}
    rates = perf.throughput({**counts, "timing/rollout": 1.5, "timing/train": 3.0}, step_seconds=4.0)
    assert rates == {
        "perf/generated_tokens_per_s": 2.0,
        "perf/trained_tokens_per_s": 2.0,
        "perf/samples_per_s": 0.5,
    }
    # a phase that took no time (or was not timed) gives no rate rather than a division by zero
    assert perf.throughput({**counts, "timing/rollout": 0.0}, step_seconds=0.0) == {}


def test_forward_flops_against_a_loop():
    seq_lens, params, layers, width = [3, 10, 1], 1000, 4, 64
    expected = 0
    for s in seq_lens:
        expected += 2 * params * s  # one multiply-add per parameter per token
        for _layer in range(layers):
            for q in range(s):  # causal: query q attends to q + 1 keys; QK^T and AV, 2 * width flops each
                expected += 2 * 2 * width * (q + 1)
    # the closed form counts s^2 / 2 attended pairs per head dimension instead of s(s+1)/2
    closed = perf.forward_flops(seq_lens, params, layers, width)
    diagonal = sum(2 * 2 * width * s * layers for s in seq_lens) / 2
    assert closed == pytest.approx(expected - diagonal)


def test_matmul_params_and_mfu():
    assert perf.matmul_params(1100, 100, tied_embeddings=False) == 1000
    assert perf.matmul_params(1100, 100, tied_embeddings=True) == 1100
    assert perf.mfu(989e12 * 8 * 2 * 0.5, seconds=2.0, num_devices=8, device_peak=989e12) == pytest.approx(
        0.5
    )
    with pytest.raises(ValueError, match="seconds=0"):
        perf.mfu(1.0, 0, 1, 1.0)


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0),
     ("NVIDIA H200", 989.0), ("Tesla T4", None)],
)  # fmt: skip
def test_peak_flops_lookup(name, tflops):
    assert perf.peak_flops(name) == (None if tflops is None else tflops * 1e12)


def test_peak_rss_is_positive():
    assert 0.0 < perf.peak_rss_gb() < 1024.0


@pytest.mark.parametrize("tied", [True, False])
def test_model_forward_flops_reads_the_hf_config(tied):
    """Parameters counted once (a tied LM head is the embedding), the embedding lookup is no matmul, and the
    attention width is heads x head_dim (Qwen3's head_dim is not hidden_size / heads)."""
    from miles.tools.tiny_model import tiny_config, tiny_model

    c = tiny_config(50, hidden_size=32, intermediate_size=48, head_dim=16, tie_word_embeddings=tied)
    model = tiny_model(c, seed=0)
    total = sum(p.numel() for p in model.parameters())
    matmul = (
        total - 50 * 32 if not tied else total
    )  # untied: the input embedding is a lookup; tied: it is the head
    expected = perf.forward_flops([5, 2], matmul, 2, 4 * 16)
    assert perf.model_forward_flops(model, [5, 2]) == expected
