"""Performance metrics per rollout (`perf/*`): throughput, peak memory per process, and an MFU estimate on CUDA.

Pure functions (no torch import at module level), so the driver and the trainer compute them the same way:

- `sample_counts(samples)`: samples, generated (response) tokens and trained (prompt + response) tokens;
- `throughput(metrics, step_seconds)`: those counts divided by the phase times the driver measured;
- `forward_flops(...)` / `model_forward_flops(model, seq_lens)` / `mfu(...)`: model FLOPs of the training passes against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from miles.utils.types import Sample

# Dense (no sparsity) bf16 tensor-core peak per GPU, TFLOP/s, from the vendors' data sheets. Matched as a
# substring of torch.cuda.get_device_name(), first match wins (so "H100 PCIe" precedes "H100").
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)


def sample_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """`perf/samples`, `perf/generated_tokens` (response tokens) and `perf/trained_tokens` (prompt + response)."""
    return {
        "perf/samples": float(len(samples)),
        "perf/generated_tokens": float(sum(s.response_length for s in samples)),
        "perf/trained_tokens": float(sum(len(s.tokens) for s in samples)),
    }


def throughput(metrics: dict[str, float], step_seconds: float) -> dict[str, float]:
    """Rates from `sample_counts` and the driver's phase times: generated tokens per second of `timing/rollout`,
    trained tokens per second of `timing/train`, samples per second of the whole step (`step_seconds`)."""
    out: dict[str, float] = {}
    for count_key, seconds, name in (
        ("perf/generated_tokens", metrics.get("timing/rollout", 0.0), "perf/generated_tokens_per_s"),
        ("perf/trained_tokens", metrics.get("timing/train", 0.0), "perf/trained_tokens_per_s"),
        ("perf/samples", step_seconds, "perf/samples_per_s"),
    ):
        if count_key in metrics and seconds > 0:
            out[name] = metrics[count_key] / seconds
    return out


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, GiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024**3 if sys.platform == "darwin" else 1024**2)


def matmul_params(total_params: int, embedding_params: int, tied_embeddings: bool) -> int:
    """Parameters that take part in a matmul per token: all but the input-embedding lookup, except that a tied
    embedding is also the output projection."""
    return total_params if tied_embeddings else total_params - embedding_params


def forward_flops(seq_lens: Sequence[int], params: int, num_layers: int, attn_width: int) -> float:
    """FLOPs of one forward over sequences of `seq_lens` tokens: 2 * params per token for the matmuls, plus causal
    attention, 2 * num_layers * attn_width * s^2 per sequence (QK^T and AV, 2 s^2 d each, halved by the mask)."""
    return float(sum(2 * params * s + 2 * num_layers * attn_width * s * s for s in seq_lens))


def model_forward_flops(model: nn.Module, seq_lens: Sequence[int]) -> float:
    """`forward_flops` of a HF causal LM (its config and parameters) over sequences of `seq_lens` tokens."""
    c = model.config
    embed = model.get_input_embeddings().weight.numel()
    params = matmul_params(sum(p.numel() for p in model.parameters()), embed, c.tie_word_embeddings)
    width = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return forward_flops(seq_lens, params, c.num_hidden_layers, width)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the named GPU, or None when it is not in PEAK_BF16_TFLOPS."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def mfu(flops: float, seconds: float, num_devices: int, device_peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak of all `num_devices`."""
    if seconds <= 0 or num_devices <= 0 or device_peak <= 0:
        raise ValueError(f"mfu: seconds={seconds}, num_devices={num_devices}, peak={device_peak} must be > 0")
    return flops / (seconds * num_devices * device_peak)
