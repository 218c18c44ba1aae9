"""Block FP8 of the refit (miles.refit.fp8) against a plain loop over blocks, bit for bit."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from miles.refit.fp8 import (
    FP8_DTYPE,
    dequantize_block_fp8,
    dequantize_named,
    is_quantized,
    quantize_block_fp8,
    quantize_bucket,
)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _pow2_up(x: float) -> float:
    """The smallest power of two >= x (x a positive normal float32), from its exponent and mantissa."""
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent


def reference(w: torch.Tensor, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One block at a time, one element at a time: amax, scale, e4m3 (the cast of one float32 scalar)."""
    x = w.float()
    m, n = x.shape
    rows, cols = -(-m // 128), -(-n // 128)
    q = torch.empty(m, n, dtype=FP8_DTYPE)
    scales = torch.empty(rows, cols, dtype=torch.float32)
    eps = 1e-10 if scale_format == "float" else 1e-4
    for bi in range(rows):
        for bj in range(cols):
            block = x[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            amax = max([abs(float(v)) for v in block.flatten()] + [0.0])
            amax = max(_f32(amax), _f32(eps))
            scale = _f32(amax / 448.0)
            if scale_format == "ue8m0":
                scale = _pow2_up(scale)
            scales[bi, bj] = scale
            inv = _f32(1.0 / scale)
            for i in range(block.shape[0]):
                for j in range(block.shape[1]):
                    v = min(max(_f32(float(block[i, j]) * inv), -448.0), 448.0)
                    q[bi * 128 + i, bj * 128 + j] = torch.tensor(v, dtype=torch.float32).to(FP8_DTYPE)
    return q, scales


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scale_format", ["float", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_plain_loop_bit_for_bit(scale_format, dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(130, 200, generator=g) * 0.05).to(dtype)  # edge blocks: 2 rows, 72 columns
    w[:128, 128:] = 0.0  # an all-zero block
    w[128:, :128] *= 1e4  # a block with large values
    q, s = quantize_block_fp8(w, scale_format)
    q_ref, s_ref = reference(w, scale_format)
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    assert torch.equal(s, s_ref)
    assert q.dtype == FP8_DTYPE and _same_bits(q, q_ref)
    assert torch.count_nonzero(q[:128, 128:].float()) == 0  # the zero block stays zero
    if scale_format == "ue8m0":
        mantissa, _ = torch.frexp(s)
        assert torch.all(mantissa == 0.5)  # powers of two


def test_scales_follow_the_block_amax():
    w = torch.zeros(256, 128)
    w[0, 0], w[200, 5] = 448.0, -0.75
    q, s = quantize_block_fp8(w)
    assert s.tolist() == [[1.0], [_f32(0.75 / 448.0)]]
    assert q[0, 0].float() == 448.0 and q[200, 5].float() == -448.0
    _, s2 = quantize_block_fp8(w, "ue8m0")
    assert s2.tolist() == [[1.0], [2.0**-9]]  # 0.75/448 = 1.67e-3 -> 2**-9 = 1.95e-3


def test_dequantized_weight_is_close():
    w = torch.randn(300, 257) * 0.02
    q, s = quantize_block_fp8(w)
    back = dequantize_block_fp8(q, s)
    assert back.shape == w.shape
    rel = (back - w).abs().max() / w.abs().max()
    assert 0 < rel < 2**-4  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_refused(bad):
    w = torch.randn(4, 4)
    w[1, 2] = bad
    with pytest.raises(ValueError, match=r"--rollout-weight-quantization fp8.*1 inf/nan"):
        quantize_block_fp8(w)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_block_fp8(torch.randn(4))
    with pytest.raises(ValueError, match="scale format 'e8'"):
        quantize_block_fp8(torch.randn(4, 4), "e8")
    with pytest.raises(ValueError, match=r"expected \(1, 1\)"):
        dequantize_block_fp8(torch.zeros(4, 4, dtype=FP8_DTYPE), torch.ones(2, 1))


def test_only_linear_projection_weights_are_quantized():
    w2, w1 = torch.randn(4, 4), torch.randn(4)
    assert is_quantized("model.layers.0.self_attn.q_proj.weight", w2)
    assert is_quantized("model.layers.3.mlp.down_proj.weight", w2)
    assert is_quantized("model.layers.3.mlp.gate_up_proj.weight", w2)
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        assert not is_quantized(name, w2), name  # fmt: skip
    assert not is_quantized("model.layers.0.self_attn.q_proj.bias", w1)
    assert not is_quantized("model.layers.0.self_attn.q_proj.weight", w2.long())


def test_bucket_round_trip_through_the_engine_side():
    bucket = [
        ("model.embed_tokens.weight", torch.randn(10, 8)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8)),
    ]
    sent = quantize_bucket(bucket, "float")
    assert [n for n, _ in sent] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.bias",
    ]
    assert sent[0][1] is bucket[0][1] and sent[1][1].dtype == FP8_DTYPE
    plain, received = dequantize_named(sent)
    assert [n for n, _ in plain] == [n for n, _ in bucket]
    assert torch.equal(plain[1][1], dequantize_block_fp8(sent[1][1], sent[2][1]))
    assert [n for n, _ in received] == [sent[1][0], sent[2][0]]
    with pytest.raises(ValueError, match="without its block scales"):
        dequantize_named(sent[:2])
    with pytest.raises(ValueError, match="without their weight"):
        dequantize_named([sent[2]])
