"""A tiny random Qwen3 model + word-level tokenizer on disk, for engine tests and smoke runs (no model hub)."""

from __future__ import annotations

from pathlib import Path

WORDS = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "home", "is", "big", "small", "red",
    "blue", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "yes", "no", "stop",
    "go", "up", "down", "left", "right", "in", "out", "hello", "world", "answer", "question", ".", ",", "!", "?",
]  # fmt: skip
SPECIALS = ["<pad>", "<unk>", "<eos>"]


def build_tiny_model(
    path: str | Path,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a random tiny Qwen3ForCausalLM and a matching PreTrainedTokenizerFast to `path`; returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(path)
    config = Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so sampling is not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path
