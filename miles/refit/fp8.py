"""Block FP8 for rollout engines (``--rollout-weight-quantization fp8``): the linear layers' weights are sent as
float8_e4m3fn with one float32 scale per 128x128 block, under the names SGLang loads block-FP8 checkpoints by
(``<name>`` holds the e4m3 values, ``<name>_scale_inv`` the scales, e.g. ``...q_proj.weight_scale_inv``;
sglang/srt/layers/quantization/fp8.py registers ``weight_scale_inv`` of shape ``(ceil(N/128), ceil(K/128))``).
The scale is the dequantization multiplier: ``weight ~= e4m3 * scale`` block by block.

Per block (edge blocks are the partial ones, padded with zeros): ``amax = max |w|`` in float32, then

- ``float`` scales (the layout of DeepSeek-style FP8 checkpoints): ``scale = max(amax, 1e-10) / 448``;
- ``ue8m0`` scales (power of two, what SGLang's DeepGEMM path wants): ``scale`` is ``max(amax, 1e-4) / 448``
  rounded up to a power of two (its float32 exponent raised by one unless the mantissa is zero, clamped to the
  normal range);

and ``e4m3 = clamp(w * (1 / scale), -448, 448)`` rounded to nearest even. An all-zero block has the smallest
scale and zero values. Infinite or NaN weights are refused (``ValueError``). Everything here is a pure function
of its inputs, the same on CPU and GPU (no kernels of SGLang or DeepGEMM needed).
"""

from __future__ import annotations

import re

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
SCALE_FORMATS = ("float", "ue8m0")
FLAG = "--rollout-weight-quantization"
_EPS = {"float": 1e-10, "ue8m0": 1e-4}  # amax floor per scale format (an all-zero block's scale)

# the HF names of the linear layers whose weights are quantized (attention and MLP projections, fused or not);
# embeddings, norms, lm_head, biases and routers stay as they are
_LINEAR = re.compile(r"\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj\.weight$")


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the weight ``name`` is sent as block FP8: a floating 2-D weight of a linear projection."""
    return bool(_LINEAR.search(name)) and tensor.dim() == 2 and tensor.is_floating_point()


def scale_name(name: str) -> str:
    """The name of ``name``'s block scales (SGLang's): ``a.q_proj.weight`` -> ``a.q_proj.weight_scale_inv``."""
    return name + SCALE_SUFFIX


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 ``x`` rounded up to a power of two, by its bits: the exponent goes up by one when the
    mantissa is not zero, clamped to [1, 254] (normal floats)."""
    bits = x.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def quantize_block_fp8(
    weight: torch.Tensor, scale_format: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D, floating) as ``(e4m3 values of its shape, float32 scales (ceil(M/128), ceil(N/128)))``
    by the rules of the module docstring."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale format {scale_format!r}: allowed {list(SCALE_FORMATS)}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"block FP8 needs a 2-D floating weight, got {tuple(weight.shape)} {weight.dtype}")
    x = weight.detach().float()
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"{FLAG} fp8: the weight of shape {tuple(weight.shape)} holds {bad} inf/nan values, which have no "
            "FP8 block scale (the training diverged?)"
        )
    m, n = x.shape
    mb, nb = -(-m // BLOCK), -(-n // BLOCK)
    padded = x.new_zeros(mb * BLOCK, nb * BLOCK)
    padded[:m, :n] = x
    blocks = padded.view(mb, BLOCK, nb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=_EPS[scale_format])
    scale = amax / FP8_MAX
    if scale_format == "ue8m0":
        scale = ceil_pow2(scale)
    inv = (1.0 / scale)[:, None, :, None]
    q = (blocks * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(mb * BLOCK, nb * BLOCK)[:m, :n].contiguous(), scale.contiguous()


def dequantize_block_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight block FP8 stands for: ``e4m3 * scale`` of its block in float32, cast to ``dtype`` (what
    SGLang's ``block_quant_dequant`` computes)."""
    m, n = q.shape
    mb, nb = -(-m // BLOCK), -(-n // BLOCK)
    if tuple(scale.shape) != (mb, nb):
        raise ValueError(
            f"block scales {tuple(scale.shape)} do not fit a {m}x{n} weight: expected ({mb}, {nb})"
        )
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:m, :n]
    return (q.float() * full).to(dtype)


def quantize_bucket(
    bucket: list[tuple[str, torch.Tensor]], scale_format: str
) -> list[tuple[str, torch.Tensor]]:
    """``bucket`` with every linear weight (`is_quantized`) replaced by its e4m3 values and, right after, its
    block scales (`scale_name`); other tensors unchanged, in order."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in bucket:
        if is_quantized(name, t):
            q, scale = quantize_block_fp8(t, scale_format)
            out += [(name, q), (scale_name(name), scale)]
        else:
            out.append((name, t))
    return out


def dequantize_named(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """An engine's side: named tensors as they arrived (e4m3 weights each with its ``_scale_inv``, anything else
    as it is) -> ``(tensors to load, with the FP8 pairs dequantized to float32; the FP8 tensors as received)``.
    A scale without its weight, or an e4m3 weight without its scales, is a ValueError naming it."""
    by_name = dict(named)
    plain: list[tuple[str, torch.Tensor]] = []
    received: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
            if weight not in by_name:
                raise ValueError(f"{name!r}: block scales without their weight {weight!r} in the same bucket")
            continue
        if t.dtype != FP8_DTYPE:
            plain.append((name, t))
            continue
        scale = by_name.get(scale_name(name))
        if scale is None:
            raise ValueError(f"{name!r} arrived as {t.dtype} without its block scales {scale_name(name)!r}")
        plain.append((name, dequantize_block_fp8(t, scale)))
        received += [(name, t), (scale_name(name), scale)]
    return plain, received
