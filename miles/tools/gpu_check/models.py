"""Qwen3-architecture checkpoints with random weights, built locally for the GPU check (no model hub).

A checkpoint directory holds `config.json`, safetensors weights in the check's dtype and a word-level tokenizer
with exactly `vocab_size` entries (so every id a random model samples decodes). The sizes of the real Qwen3
models are kept (hidden size, layers, heads, vocabulary), the context is shortened to `max_position_embeddings`
so the embedded engine's KV cache stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SPECIALS = ("<pad>", "<unk>", "<eos>")
EOS_ID = 2


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


def qwen3_config(preset: Preset):  # -> transformers.Qwen3Config
    """The transformers config of `preset` (tied embeddings, as the small Qwen3 models)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        bos_token_id=None,
    )


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(path)


def build_checkpoint(
    path: str | Path, preset: Preset, seed: int, dtype: torch.dtype, device: torch.device
) -> Path:
    """Write a random Qwen3 model of shape `preset` (HF init, seeded) and its tokenizer to `path`.

    The weights are initialised on `device` (fast on a GPU) and saved in `dtype`. Returns `path`.
    """
    from transformers import Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(qwen3_config(preset))
    model.to(dtype).save_pretrained(path)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine process needs the memory
    _save_tokenizer(path, preset.vocab_size)
    return path
