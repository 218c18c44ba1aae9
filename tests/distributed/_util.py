"""Spawn N CPU processes joined in a gloo process group, for multi-process tests.

Usage::

    def _body(rank: int, world_size: int, tmp: str) -> None:   # module-level, so spawn can pickle it
        ...  # torch.distributed is initialised (gloo) when the body runs

    run_distributed(_body, 2, str(tmp_path))

Each process gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in its environment, one torch thread,
HF_HUB_OFFLINE=1, and an initialised default gloo group (``init_pg=False`` leaves that to the body, e.g. to test
`init_distributed`). An exception in any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, init_pg: bool, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    torch.set_num_threads(1)
    if init_pg:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, init_pg: bool = True) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; raise if any rank fails."""
    mp.start_processes(
        _worker,
        args=(world_size, free_port(), init_pg, fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )


def save_tiny_qwen3(path: str, seed: int = 0, tie_word_embeddings: bool = True, vocab_size: int = 96) -> str:
    """Write a random 2-layer Qwen3 causal LM (hidden 32) in HF format to ``path``; returns ``path``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path
