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
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.utils.net import free_port

__all__ = ["free_port", "run_distributed", "save_tiny_qwen3"]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    init_pg: bool,
    err_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
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
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)  # skip atexit/destroy: peers may be blocked in a collective with us
    if dist.is_initialized():
        dist.barrier()  # no rank tears its group down while a peer is still inside a collective
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a native thread (gloo, torch's pools) still joinable in a static destructor aborts
    # the process ("terminate called without an active exception", exit -6) after the body has succeeded.
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, init_pg: bool = True, timeout_s: float = 240.0
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; raise if any rank fails.

    Children are reaped by polling (not by waiting on their sentinel pipes: helper daemons a child starts, such
    as torch_shm_manager for shared-memory tensors, inherit those pipes and would keep them open). When one rank
    fails the others are terminated; after ``timeout_s`` all are.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="miles_dist_") as err_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, init_pg, err_dir, fn, args), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        timed_out = any(p.is_alive() for p in procs) and time.monotonic() > deadline
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = [
            f"--- rank {r} ---\n" + open(os.path.join(err_dir, f"rank{r}.txt")).read()
            for r in range(world_size)
            if os.path.exists(os.path.join(err_dir, f"rank{r}.txt"))
        ]
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    if timed_out:
        raise TimeoutError(f"distributed test did not finish within {timeout_s}s")
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise RuntimeError(f"ranks exited abnormally (rank: exit code): {bad}")


def save_tiny_qwen3(path: str, seed: int = 0, tie_word_embeddings: bool = True, vocab_size: int = 96) -> str:
    """Write the tests' random 2-layer Qwen3 causal LM (hidden 32) in HF format to ``path``; returns ``path``."""
    from tests.tiny_models import tiny_qwen3

    tiny_qwen3(seed, vocab_size, tie_word_embeddings).save_pretrained(path)
    return path


def wait_until_gone(pid: int, what: str, timeout: float = 30.0) -> None:
    """Wait up to `timeout` s for process `pid` to exit; past it, kill it and fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    raise AssertionError(f"{what} outlived its parent")
