"""What the GPU checks share: their settings, their result record and the tolerances they apply."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.tools.gpu_check.models import Preset
from miles.utils.types import Sample, SampleStatus


@dataclass(frozen=True)
class Tolerances:
    """Largest |Δ log-prob| accepted, per (device, dtype).

    fp32: the architecture's guarantee, 1e-5 on CPU; on CUDA 1e-4 (mean) since kernels reduce in other orders.
    bf16: measured on CPU with the `small` preset (8 layers), engine vs trainer differ by 0.004 on average and
    0.02 at most, packed vs per-sequence by 0 (the same SDPA kernel). On a GPU the trainer's flash-attn and the
    engine's SDPA round differently and 28 layers accumulate more, so the bounds leave about 10x room. A wrong
    weight, position or temperature moves log-probs by O(0.1 - 1) on average: the generation check also requires
    the engine's log-probs before the refit (another seed's weights) to differ by at least `POWER` x `gen_mean`.
    Measured on an H200 with the 1.7b preset (28 layers, torch varlen attention, 2026-11): packed vs per-sequence
    mean 0.025 / max 0.14, engine vs trainer mean 0.033 / max 0.14 (before the refit: mean 1.64), so the CUDA bf16
    mean bound is 0.06.
    """

    varlen_max: float  # packed varlen forward vs per-sequence forwards, max over tokens
    gen_mean: float  # engine vs trainer on the engine's samples, mean over tokens
    gen_max: float  # ... max over tokens


POWER = 5.0
TOLERANCES: dict[tuple[str, torch.dtype], Tolerances] = {
    ("cpu", torch.float32): Tolerances(1e-5, 1e-5, 1e-5),
    ("cuda", torch.float32): Tolerances(1e-4, 1e-4, 1e-3),
    ("cpu", torch.bfloat16): Tolerances(0.25, 0.03, 0.5),
    ("cuda", torch.bfloat16): Tolerances(0.25, 0.06, 0.5),
}


@dataclass
class Settings:
    """One run of the checks (the command line, resolved)."""

    device: torch.device
    dtype: torch.dtype
    preset_name: str
    preset: Preset
    workdir: Path
    num_seqs: int  # training samples per step (pairs of one prompt)
    seq_len: int  # tokens of the longest training sample
    max_tokens_per_mb: int  # token budget of one packed micro-batch
    gen_prompts: int
    gen_tokens: int
    bucket_bytes: int
    temperature: float = 0.8
    seed: int = 0
    peak_tflops: float | None = None  # None: miles.utils.perf's table for the GPU
    flash: bool = False  # a CUDA varlen kernel (flash-attn, else torch's): the trainer's packed attention
    fused: bool = True  # --fused-elementwise (compiled RMSNorm/rotary/SwiGLU on CUDA)
    profile: Path | None = None  # torch-profile the timed train step, write the op table here

    @property
    def tolerances(self) -> Tolerances:
        return TOLERANCES[(self.device.type, self.dtype)]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass
class CheckResult:
    """One check: passed or not, a one-line summary with its numbers, and the numbers themselves."""

    name: str
    passed: bool
    summary: str
    numbers: dict[str, float | int | str | None] = field(default_factory=dict)


def sync(device: torch.device) -> None:
    """Wait for the device (timings of CUDA work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_samples(s: Settings) -> list[Sample]:
    """`num_seqs` samples in prompt pairs, lengths from seq_len/2 to seq_len (so packing has work), random
    tokens, a prompt of a quarter of the sample, rewards that differ within each pair."""
    rng = random.Random(s.seed)
    vocab = s.preset.vocab_size
    out = []
    for i in range(s.num_seqs):
        length = s.seq_len - (i % 4) * s.seq_len // 8
        prompt_len = max(1, length // 4)
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(
            Sample(
                index=i,
                group_index=i // 2,
                tokens=tokens,
                response_length=length - prompt_len,
                loss_mask=[1] * (length - prompt_len),
                rollout_log_probs=None,
                reward=float(i % 2),
                status=SampleStatus.COMPLETED,
            )
        )
    return out
