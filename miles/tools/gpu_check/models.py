"""Qwen3-architecture checkpoints with random weights, built locally for the GPU check (no model hub).

A checkpoint directory holds `config.json`, safetensors weights in the check's dtype and a word-level tokenizer
with exactly `vocab_size` entries (so every id a random model samples decodes). The sizes of the real Qwen3
models are kept (hidden size, layers, heads, vocabulary), the context is shortened to `max_position_embeddings`
so the embedded engine's KV cache stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from miles.tools.tiny_model import WORD_SPECIALS, tiny_config, tiny_model, word_tokenizer

if TYPE_CHECKING:
    from transformers import Qwen3Config


@dataclass(frozen=True)
class Preset:
    """The shape of a Qwen3 model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 16, 128, 256, 512),  # CPU test
    "small": Preset(512, 8, 8, 4, 64, 1536, 32000),  # quick runs; bf16 tolerances measured on CPU with it
    "0.6b": Preset(1024, 28, 16, 8, 128, 3072, 151936),  # Qwen3-0.6B
    "1.7b": Preset(2048, 28, 16, 8, 128, 6144, 151936),  # Qwen3-1.7B
}


def qwen3_config(preset: Preset) -> Qwen3Config:
    """The transformers config of `preset` (tied embeddings, as the small Qwen3 models)."""
    return tiny_config(
        preset.vocab_size,
        hidden_size=preset.hidden_size,
        num_layers=preset.num_layers,
        num_heads=preset.num_heads,
        num_kv_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        intermediate_size=preset.intermediate_size,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=WORD_SPECIALS.index("<eos>"),
        pad_token_id=WORD_SPECIALS.index("<pad>"),
    )


def build_checkpoint(
    path: str | Path, preset: Preset, seed: int, dtype: torch.dtype, device: torch.device
) -> Path:
    """Write a random Qwen3 model of shape `preset` (HF init, seeded) and its tokenizer to `path`.

    The weights are initialised on `device` (fast on a GPU) and saved in `dtype`. The word-level tokenizer has
    exactly `preset.vocab_size` entries (`w3`, `w4`, ... after the specials). Returns `path`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_model(qwen3_config(preset), seed, device=device)
    model.to(dtype).save_pretrained(path)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine process needs the memory
    words = [f"w{i}" for i in range(len(WORD_SPECIALS), preset.vocab_size)]
    word_tokenizer(words).save_pretrained(path)
    return path
