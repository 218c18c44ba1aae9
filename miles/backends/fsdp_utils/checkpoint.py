"""Sharded, atomic checkpoints: model + optimizer (DCP), LR scheduler, counters, extra state, per-rank RNG.

Layout of one checkpoint (``save_dir`` must be visible to every rank, e.g. a shared filesystem)::

    save_dir/
      latest_checkpointed_iteration.txt     "7" -> iter_0000007 (written last, atomically)
      iter_0000007/
        .metadata, __0_0.distcp, ...         DCP shards of {"model": ..., "optimizer": ...}
        meta.pt                              rollout_id, next_rollout_id, world_size, lr_scheduler, extra_state
        rng/rank_00000.pt, ...               python / numpy / torch (/ cuda) RNG state of each rank

Atomicity: everything is written to ``iter_XXXXXXX.tmp/``; after a barrier rank 0 renames it to
``iter_XXXXXXX`` and only then replaces the tracker file (write to a temp file + ``os.replace``). `load_checkpoint`
reads only what the tracker names, so a crash at any point of a save leaves the previous checkpoint in charge.

RNG and world size: RNG state is per rank. When a checkpoint is loaded with a different world size there is no
meaningful mapping of old ranks to new ones, so RNG is *not* restored (each rank keeps its current, freshly seeded
generators) and a warning is logged; model/optimizer shards are resharded by DCP as usual.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from miles.backends.fsdp_utils.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7})$")


def checkpoint_dir(root: str | os.PathLike, rollout_id: int) -> Path:
    """``root/iter_{rollout_id:07d}``."""
    return Path(root) / f"iter_{rollout_id:07d}"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _train_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tracker(root: Path, rollout_id: int) -> None:
    tmp = root / f"{TRACKER_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{rollout_id}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER_FILE)
    _fsync_dir(root)


def _commit(tmp: Path, final: Path) -> None:
    """Rank 0: move the finished ``tmp`` dir into place (replacing an older save of the same id)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int, protect: int) -> None:
    ids = sorted(int(m.group(1)) for p in root.iterdir() if (m := _ITER_RE.match(p.name)))
    for rid in ids[: max(0, len(ids) - keep_last)]:
        if rid != protect:
            shutil.rmtree(checkpoint_dir(root, rid), ignore_errors=True)


def save_checkpoint(
    save_dir: str | os.PathLike,
    rollout_id: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: LRScheduler | None,
    extra_state: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``rollout_id`` atomically; returns its final directory. Collective over all ranks.

    ``extra_state`` (e.g. the data-source cursor) is stored as given by rank 0 and returned by
    `load_checkpoint`. ``keep_last`` (>= 1) deletes older ``iter_*`` directories after the tracker is updated.
    """
    if rollout_id < 0:
        raise ValueError(f"rollout_id={rollout_id}: must be >= 0")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1 (or None to keep every checkpoint)")
    rank, world_size = _rank_world()
    root = Path(save_dir)
    final = checkpoint_dir(root, rollout_id)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save
        (tmp / "rng").mkdir(parents=True)
    _barrier()

    dcp.save(_train_state(model, optimizer), checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        meta = {
            "rollout_id": rollout_id,
            "next_rollout_id": rollout_id + 1,
            "world_size": world_size,
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "extra_state": dict(extra_state or {}),
        }
        torch.save(meta, tmp / "meta.pt")
    _barrier()  # every rank's files are complete

    if rank == 0:
        _commit(tmp, final)
        _write_tracker(root, rollout_id)
        if keep_last is not None:
            _prune(root, keep_last, protect=rollout_id)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def read_tracker(load_dir: str | os.PathLike) -> int | None:
    """The rollout id named by ``load_dir``'s tracker file, or None when there is none."""
    tracker = Path(load_dir) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected a rollout id, found {text!r}")
    return int(text)


def load_checkpoint(
    load_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: LRScheduler | None,
) -> dict[str, Any] | None:
    """Restore the checkpoint named by the tracker file; None when ``load_dir`` has no tracker.

    Returns ``{"next_rollout_id": int, "extra_state": dict}``. Restores model (and optimizer, scheduler when
    given) and this rank's RNG (skipped, with a warning, when the world size differs from the saving run).
    Collective over all ranks.
    """
    rollout_id = read_tracker(load_dir)
    if rollout_id is None:
        return None
    path = checkpoint_dir(load_dir, rollout_id)
    old = path.with_name(path.name + ".old")
    if not (path / "meta.pt").exists() and (old / "meta.pt").exists():
        path = old  # a re-save of the same id crashed between its two renames: the previous copy is complete
    if not (path / "meta.pt").exists():
        raise FileNotFoundError(
            f"{Path(load_dir) / TRACKER_FILE} names rollout {rollout_id} but {path} is incomplete"
        )
    meta = torch.load(path / "meta.pt", weights_only=False)

    state = _train_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if lr_scheduler is not None:
        if meta["lr_scheduler"] is None:
            raise ValueError(f"{path} holds no LR scheduler state, but a scheduler was given to restore")
        lr_scheduler.load_state_dict(meta["lr_scheduler"])

    rank, world_size = _rank_world()
    if world_size == meta["world_size"]:
        _set_rng_state(torch.load(path / "rng" / f"rank_{rank:05d}.pt", weights_only=False))
    elif rank == 0:
        logger.warning(
            "%s was saved by %d ranks, loading with %d: RNG state not restored (kept the current seeding)",
            path,
            meta["world_size"],
            world_size,
        )
    _barrier()
    logger.info("loaded checkpoint %s (next rollout %d)", path, meta["next_rollout_id"])
    return {"next_rollout_id": meta["next_rollout_id"], "extra_state": meta["extra_state"]}
