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

Errors: a failed write on any rank (a full disk reads "no space left on <path>") removes the ``.tmp`` directory and
raises on every rank, naming the checkpoint; the tracker still names the previous checkpoint. Loading checks
every file before reading it: a truncated or missing DCP shard, ``meta.pt`` or RNG file is a ValueError naming
the file. ``meta.pt`` and the RNG files hold only plain values and tensors and load with ``weights_only=True``.

RNG and world size: RNG state is per rank. When a checkpoint is loaded with a different world size there is no
meaningful mapping of old ranks to new ones, so RNG is *not* restored (each rank keeps its current, freshly seeded
generators) and a warning is logged; model/optimizer shards are resharded by DCP as usual.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from miles.backends.fsdp_utils.lr_scheduler import LRScheduler
from miles.utils.types import JSON

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7})$")


def checkpoint_dir(root: str | os.PathLike[str], rollout_id: int) -> Path:
    """``root/iter_{rollout_id:07d}``."""
    return Path(root) / f"iter_{rollout_id:07d}"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumeInfo(TypedDict):
    """What `load_checkpoint` returns: where the run goes on, and the state saved with the checkpoint."""

    next_rollout_id: int
    extra_state: dict[str, JSON]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    """RNG state as plain values and tensors only (the numpy key array becomes a tensor), so that it loads
    with ``torch.load(weights_only=True)``."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple), "the legacy MT19937 state is a tuple"
    kind, keys, pos, has_gauss, cached = legacy
    state = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(keys.copy()), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _frozen_names(model: nn.Module) -> set[str]:
    """Parameters that never train (the base of a LoRA model): checkpoints leave them out, since they are
    reloaded from --hf-checkpoint at init and never change."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _train_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    frozen = _frozen_names(model)
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        return {"model": {k: v for k, v in model_sd.items() if k not in frozen}}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": {k: v for k, v in model_sd.items() if k not in frozen}, "optimizer": optim_sd}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tracker(root: Path, rollout_id: int) -> None:
    tmp = root / f"{TRACKER_FILE}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(f"{rollout_id}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / TRACKER_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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


def _any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (collective; plain `flag` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _chain(error: BaseException | None) -> list[BaseException]:
    """`error`, its causes and contexts, and the per-rank failures a DCP CheckpointException carries."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is x for x in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [exc for exc, _ in e.failures.values()]
    return seen


def _root_cause(error: BaseException) -> BaseException:
    """The first error of the chain that is not a DCP CheckpointException wrapper (whose text is a traceback)."""
    return next((e for e in _chain(error) if not isinstance(e, CheckpointException)), error)


def _describe(error: BaseException) -> str:
    cause = _root_cause(error)
    return f"{type(cause).__name__}: {cause}"


_FREE_WHEN_FULL = 64 * 1024**2  # bytes: a write that failed with less than this free ran out of space


def _is_disk_full(error: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of space. Call it before removing the partial files: torch.save reports
    a short write as "[enforce fail at inline_container.cc] ..." without an errno, so the free space decides."""
    chain = _chain(error)
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain):
        return True
    io_error = any(
        isinstance(e, OSError) or any(m in str(e) for m in ("inline_container", "PytorchStreamWriter"))
        for e in chain
    )
    try:
        return io_error and shutil.disk_usage(where).free < _FREE_WHEN_FULL
    except OSError:
        return False


def _save_error(error: BaseException | None, disk_full: bool, final: Path, tmp: Path, rank: int) -> Exception:
    if error is None:
        return RuntimeError(
            f"saving checkpoint {final} failed on another rank (its error is in that rank's log)"
        )
    if disk_full:
        return OSError(
            errno.ENOSPC,
            f"no space left on {final.parent} while saving checkpoint {final} (rank {rank}); "
            f"removed the partial {tmp.name} (the latest checkpoint is unchanged)",
        )
    return RuntimeError(
        f"saving checkpoint {final} failed on rank {rank}: {_describe(error)}; removed the partial {tmp.name}"
    )


def save_checkpoint(
    save_dir: str | os.PathLike[str],
    rollout_id: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: LRScheduler | None,
    extra_state: dict[str, JSON] | None = None,
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

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save
            (tmp / "rng").mkdir(parents=True)

    def write() -> None:
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

    def commit() -> None:
        if rank == 0:
            _commit(tmp, final)
            _write_tracker(root, rollout_id)
            if keep_last is not None:
                _prune(root, keep_last, protect=rollout_id)
            logger.info("saved checkpoint %s", final)

    for step in (prepare, write, commit):  # each ends in a collective, so a failure raises on every rank
        _run_save_step(step, final, tmp, rank)
    return final


def _run_save_step(step: Callable[[], object], final: Path, tmp: Path, rank: int) -> None:
    """Run one save step on this rank; if it failed on any rank, remove the partial files and raise on all."""
    error: BaseException | None = None
    try:
        step()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised below on every rank
        error = e
    disk_full = error is not None and _is_disk_full(error, final.parent)  # before the partial files go
    if _any_rank(error is not None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        raise _save_error(error, disk_full, final, tmp, rank) from error


def read_tracker(load_dir: str | os.PathLike[str]) -> int | None:
    """The rollout id named by ``load_dir``'s tracker file, or None when there is none."""
    tracker = Path(load_dir) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected a rollout id, found {text!r}")
    return int(text)


def _torch_load(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``; ValueError naming the file when it is missing or unreadable."""
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, bad pickle, non-allowed type: name the file
        raise ValueError(
            f"checkpoint file {path} cannot be read (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e


def check_dcp_files(path: str | os.PathLike[str]) -> None:
    """Check a DCP checkpoint directory before loading it: ``.metadata`` readable and every shard file it
    names present and at least as long as the bytes it must hold. ValueError naming the file otherwise."""
    path = Path(path)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a cut pickle raises EOFError, KeyError, ...
        raise ValueError(
            f"checkpoint metadata {path / '.metadata'} cannot be read (missing, truncated or corrupt): "
            f"{_describe(e)}"
        ) from e
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise ValueError(f"checkpoint shard {shard} is missing (named by {path / '.metadata'})")
        actual = shard.stat().st_size
        if actual < size:
            raise ValueError(
                f"checkpoint shard {shard} is truncated: {actual} bytes, its metadata needs {size}"
            )


def load_checkpoint(
    load_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: LRScheduler | None,
) -> ResumeInfo | None:
    """Restore the checkpoint named by the tracker file; None when ``load_dir`` has no tracker.

    Returns ``{"next_rollout_id": int, "extra_state": dict}``. Restores model (and optimizer, scheduler when
    given) and this rank's RNG (skipped, with a warning, when the world size differs from the saving run).
    Collective over all ranks.
    """
    rollout_id = read_tracker(load_dir)
    if rollout_id is None:
        if _rank_world()[0] == 0:
            logger.info(
                "no checkpoint in %s (no %s): training starts from the initial weights",
                load_dir,
                TRACKER_FILE,
            )
        return None
    path = checkpoint_dir(load_dir, rollout_id)
    old = path.with_name(path.name + ".old")
    if not (path / "meta.pt").exists() and (old / "meta.pt").exists():
        path = old  # a re-save of the same id crashed between its two renames: the previous copy is complete
    if not (path / "meta.pt").exists():
        raise FileNotFoundError(
            f"{Path(load_dir) / TRACKER_FILE} names rollout {rollout_id} but {path} is incomplete"
        )
    meta = _torch_load(path / "meta.pt")
    check_dcp_files(path)

    state = _train_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - e.g. another model's checkpoint
        raise ValueError(f"cannot load checkpoint {path} into this model: {_describe(e)}") from e
    options = StateDictOptions(strict=not _frozen_names(model))  # a LoRA checkpoint holds no base weights
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
    if lr_scheduler is not None:
        if meta["lr_scheduler"] is None:
            raise ValueError(f"{path} holds no LR scheduler state, but a scheduler was given to restore")
        lr_scheduler.load_state_dict(meta["lr_scheduler"])

    rank, world_size = _rank_world()
    if world_size == meta["world_size"]:
        _set_rng_state(_torch_load(path / "rng" / f"rank_{rank:05d}.pt"))
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
