"""The tiny random Qwen3 models the tests build in memory (2 layers, hidden 32, 4 heads / 2 KV heads)."""

from __future__ import annotations

import torch


def tiny_qwen3_config(
    vocab_size: int = 96, tie_word_embeddings: bool = False, max_position_embeddings: int = 128
):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


def tiny_qwen3(seed: int = 0, **config_kwargs):
    """A float32 Qwen3ForCausalLM with weights drawn after `torch.manual_seed(seed)`."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(**config_kwargs)).float()
