"""The tests' in-memory tiny Qwen3 preset (2 layers, hidden 32, 4 heads / 2 KV heads), over miles.tools.tiny_model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.tools.tiny_model import tiny_config, tiny_model

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3_config(
    vocab_size: int = 96, tie_word_embeddings: bool = False, max_position_embeddings: int = 128
) -> Qwen3Config:
    return tiny_config(
        vocab_size,
        hidden_size=32,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


def tiny_qwen3(
    seed: int = 0,
    vocab_size: int = 96,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 128,
) -> Qwen3ForCausalLM:
    """A float32 Qwen3ForCausalLM with weights drawn after `torch.manual_seed(seed)`."""
    return tiny_model(tiny_qwen3_config(vocab_size, tie_word_embeddings, max_position_embeddings), seed)
