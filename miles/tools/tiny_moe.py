"""Tiny, randomly initialised Qwen3-MoE models (transformers' `Qwen3MoeForCausalLM`) with the toy task's tokenizer.

The MoE sibling of `miles.tools.tiny_model`: the same BPE tokenizer (`build_tokenizer`), the same seeded init and
the same atomic write, with every decoder layer's MLP a sparse MoE block (`num_experts` experts, `top_k` routed
per token, gate weights renormalised over the top-k as Qwen3-MoE does with `norm_topk_prob`).

    python -m miles.tools.tiny_moe --out /tmp/tiny-moe --num-experts 4 --top-k 2
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from miles.tools.tiny_model import build_tokenizer, save_model_dir
from miles.tools.toy_data import DEFAULT_TASK, TASKS

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def tiny_moe_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    initializer_range: float = 0.02,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Qwen3MoeConfig:
    """The float32 Qwen3-MoE config of a tiny model: every layer sparse, top-k renormalised, no BOS token.
    `moe_intermediate_size` defaults to the hidden size (each expert is half the dense tiny model's MLP)."""
    from transformers import Qwen3MoeConfig

    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size or hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2 if num_heads % 2 == 0 else num_heads,
        head_dim=hidden_size // num_heads,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,  # miles computes its own auxiliary loss (fsdp_utils/moe.py)
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def tiny_moe_model(config: Qwen3MoeConfig, seed: int) -> Qwen3MoeForCausalLM:
    """A float32 `Qwen3MoeForCausalLM` of `config`, initialised right after `torch.manual_seed(seed)`."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def build_tiny_moe(
    out_dir: str | os.PathLike[str],
    task: str = DEFAULT_TASK,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_experts: int = 4,
    top_k: int = 2,
    vocab_size: int = 48,
    initializer_range: float = 0.02,
    overwrite: bool = False,
) -> Path:
    """Write a tiny random Qwen3-MoE + the toy task's BPE tokenizer to `out_dir` (built in `out_dir.tmp`, then
    renamed into place); returns its path. torch's global RNG is left as it was."""
    import torch

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    tok = build_tokenizer(task, vocab_size)
    config = tiny_moe_config(
        len(tok),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_experts=num_experts,
        top_k=top_k,
        initializer_range=initializer_range,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        model = tiny_moe_model(config, seed)
    save_model_dir(model, tok, out)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m miles.tools.tiny_moe --out DIR`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument(
        "--task", default=DEFAULT_TASK, choices=sorted(TASKS), help="toy task the tokenizer covers"
    )
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2, help="experts routed per token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    a = p.parse_args(argv)
    out = build_tiny_moe(
        a.out,
        task=a.task,
        seed=a.seed,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        num_experts=a.num_experts,
        top_k=a.top_k,
        overwrite=a.overwrite,
    )
    print(f"wrote tiny Qwen3-MoE to {out}")


if __name__ == "__main__":
    main()
