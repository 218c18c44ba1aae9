"""HuggingFace export: a sharded FSDP2 model or a DCP checkpoint becomes a HF directory, and a DCP checkpoint's
model weights load into a model (``--ref-load`` of a checkpoint).

A HF directory written here (built in ``<out>.tmp``, then renamed into place, so a reader never sees half of it)::

    out/
      model-00001-of-0000N.safetensors ...     the weights, tied tensors once, in the export dtype
      model.safetensors.index.json             {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
      config.json                              the source config with "dtype" set to the export dtype
      generation_config.json, tokenizer files, chat template ...   copied from the source directory

Where config and tokenizer come from: a checkpoint written by the trainer carries them in ``iter_N/hf/``
(`write_checkpoint_hf_files`); for an older checkpoint the caller names the HF directory the run started from.

Memory: `export_sharded_model` all-gathers the model one refit bucket at a time (every rank), and rank 0 keeps at
most one output shard of full tensors on CPU; `convert_checkpoint` reads one output shard at a time from disk.
Neither ever holds two full copies of the model in one process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from miles.backends.fsdp_utils.checkpoint import checkpoint_dir, read_tracker

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES as StorageMeta
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

CKPT_HF_DIR = "hf"  # inside iter_N/: config, tokenizer and generation config of the trained model
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default max_shard_size ("5GB")
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt", ".distcp")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE_UNITS = {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "B": 1}


def dtype_from_name(name: str, flag: str = "--dtype") -> torch.dtype:
    """`float32` / `bfloat16` / `float16` as a torch dtype; ValueError naming `flag` otherwise."""
    if name not in _DTYPES:
        raise ValueError(f"{flag}={name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """Bytes from an int or a string such as `5GB`, `500MB`, `2GiB`; ValueError naming `flag` otherwise."""
    if isinstance(text, int):
        value = text
    else:
        s = text.strip().upper()
        unit = next((u for u in sorted(_SIZE_UNITS, key=len, reverse=True) if s.endswith(u)), None)
        number = s[: -len(unit)] if unit else s
        try:
            value = int(float(number) * (_SIZE_UNITS[unit] if unit else 1))
        except ValueError:
            raise ValueError(f"{flag}={text!r}: expected bytes or a size such as 5GB, 500MB, 2GiB") from None
    if value <= 0:
        raise ValueError(f"{flag}={text!r}: must be > 0")
    return value


# ----------------------------------------------------------------------------------------------- metadata files
def hf_metadata_files(source: str | os.PathLike[str]) -> list[Path]:
    """The files of HF directory `source` that are not weights: config, generation config, tokenizer, template."""
    src = Path(source)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: not a HuggingFace model directory (no config.json)")
    return sorted(
        p
        for p in src.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and not p.name.endswith(_WEIGHT_SUFFIXES)
        and not p.name.endswith(".index.json")
    )


def copy_metadata(source: str | os.PathLike[str], dst: Path, dtype: torch.dtype) -> None:
    """Copy the non-weight files of HF dir `source` into `dst`, with `dtype` in config.json."""
    for path in hf_metadata_files(source):
        shutil.copyfile(path, dst / path.name)
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = dtype_name(dtype)
    if "torch_dtype" in config:  # configs written by transformers 4.x
        config["torch_dtype"] = dtype_name(dtype)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def commit_dir(tmp: Path, final: Path) -> None:
    """Move the finished `tmp` directory to `final`, replacing an older `final` (never leaving neither)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def fresh_tmp(final: Path) -> Path:
    """An empty ``<final>.tmp`` directory to build `final` in (see `commit_dir`)."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed export
    tmp.mkdir(parents=True)
    return tmp


def write_checkpoint_hf_files(
    ckpt_dir: str | os.PathLike[str], source: str | os.PathLike[str], dtype: torch.dtype
) -> Path:
    """Store the config, tokenizer and generation config of `source` in `ckpt_dir/hf/` (atomically), with the
    training dtype in config.json, so the checkpoint converts to HF on its own. Call on one rank."""
    final = Path(ckpt_dir) / CKPT_HF_DIR
    tmp = fresh_tmp(final)
    copy_metadata(source, tmp, dtype)
    commit_dir(tmp, final)
    return final


# ----------------------------------------------------------------------------------------------- shards
class ShardWriter:
    """Writes named CPU tensors into safetensors shards of at most `max_shard_bytes` (a tensor larger than that
    gets a shard of its own), then names them `model-0000k-of-0000N.safetensors` and writes the index."""

    def __init__(self, out: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.out = out
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._parts):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"part-{len(self._parts):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._parts.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> int:
        """Write the last shard, rename all shards and write the index; returns the number of shards."""
        if self._pending:
            self._flush()
        if not self._parts:
            raise ValueError("no tensors to write")
        n = len(self._parts)
        weight_map = {}
        for k, (path, names) in enumerate(self._parts, start=1):
            name = f"model-{k:05d}-of-{n:05d}.safetensors"
            os.rename(path, self.out / name)
            weight_map.update(dict.fromkeys(names, name))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return n


# ----------------------------------------------------------------------------------------------- live export
def export_sharded_model(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    source: str | os.PathLike[str],
    dtype: torch.dtype,
    bucket_bytes: int,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the (FSDP2-sharded) `model` as a HF directory `out_dir`, config and tokenizer from `source`.

    Collective over the default group: every rank all-gathers one bucket of `bucket_bytes` at a time (the refit
    buckets); rank 0 writes. A failure on rank 0 (disk full) is raised on every rank after the walk completes,
    so no rank is left waiting in a collective. Returns `out_dir`.
    """
    from miles.refit.buckets import iter_weight_buckets

    final = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer, error = None, None
    if rank == 0:
        try:
            writer = ShardWriter(fresh_tmp(final), max_shard_bytes)
        except OSError as e:
            error = f"{final}: {e}"
    for bucket in iter_weight_buckets(model, bucket_bytes, dtype):
        if writer is None or error is not None:
            continue
        try:
            for name, tensor in bucket:
                writer.add(name, tensor)
        except (OSError, ValueError) as e:
            error = f"{final}: {e}"
    if writer is not None and error is None:  # rank 0
        try:
            num_shards = writer.finish()
            copy_metadata(source, writer.out, dtype)
            commit_dir(writer.out, final)
            logger.info("saved HF model %s (%d shards, %s)", final, num_shards, dtype_name(dtype))
        except (OSError, ValueError) as e:
            error = f"{final}: {e}"
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"HF export (--save-hf) failed on rank 0: {error}")
    return final


# ----------------------------------------------------------------------------------------------- DCP checkpoints
def resolve_dcp_checkpoint(path: str | os.PathLike[str]) -> Path | None:
    """The `iter_N` directory that `path` names: `path` itself when it holds a DCP `.metadata`, the newest
    checkpoint when it is a `--save` directory (tracker file); None when it is neither."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    rollout_id = read_tracker(p)
    if rollout_id is None:
        return None
    found = checkpoint_dir(p, rollout_id)
    old = found.with_name(found.name + ".old")
    if not (found / ".metadata").is_file() and (old / ".metadata").is_file():
        found = old  # a re-save of the same id crashed between its two renames (see checkpoint._commit)
    if not (found / ".metadata").is_file():
        raise ValueError(f"{p}: its tracker names rollout {rollout_id} but {found} holds no DCP checkpoint")
    return found


def load_model_weights(iter_dir: str | os.PathLike[str], model: nn.Module) -> None:
    """Load only the model weights of DCP checkpoint `iter_dir` into `model` (sharded or not; the optimizer
    state in the checkpoint is not read). Collective over the default group when it is initialised."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(iter_dir), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]


def export_tensor_names(config: PretrainedConfig) -> list[_Tensor]:
    """The tensors a HF checkpoint of `config` holds, in state-dict order, tied tensors once (first name):
    read from the model built on the meta device (no memory). A vision-language config (with a `vision_config`)
    is built as `AutoModelForImageTextToText`, as the trainer builds it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vl = getattr(config, "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=True)
    seen, out = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(_Tensor(name, tuple(t.shape)))
    return out


def source_dtype(source: Path) -> torch.dtype:
    """The dtype that HF dir `source`'s config.json names (float32 when it names none)."""
    config = json.loads((source / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name), torch.float32)


def convert_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    hf_source: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Convert DCP checkpoint `checkpoint` (an `iter_N` dir or a `--save` dir: its newest) into HF dir `out_dir`.

    Config and tokenizer come from the checkpoint's `hf/` dir, else from `hf_source`. `dtype` None: the
    checkpoint's training dtype (recorded in `hf/config.json`). Runs in one process (no process group).
    """
    iter_dir = resolve_dcp_checkpoint(checkpoint)
    if iter_dir is None:
        raise ValueError(
            f"--checkpoint={str(checkpoint)!r}: not a DCP checkpoint (expected an iter_N directory with "
            "a .metadata file, or a --save directory with latest_checkpointed_iteration.txt)"
        )
    source = iter_dir / CKPT_HF_DIR
    if not (source / "config.json").is_file():
        if hf_source is None:
            raise ValueError(
                f"--checkpoint={str(checkpoint)!r}: {iter_dir} has no {CKPT_HF_DIR}/ with the model config "
                "(checkpoints from before HF export); pass --hf-checkpoint DIR, the model the run started from"
            )
        source = Path(hf_source)
    final = Path(out_dir)
    if final.exists() and any(final.iterdir()) and not overwrite:
        raise ValueError(f"--out={str(out_dir)!r} exists and is not empty; pass --overwrite to replace it")
    out_dtype = dtype if dtype is not None else source_dtype(source)

    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig

    stored = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    tensors = export_tensor_names(AutoConfig.from_pretrained(source, trust_remote_code=True))
    problems = []
    for t in tensors:
        meta = stored.get(f"model.{t.name}")
        if meta is None or not hasattr(meta, "size"):
            problems.append(f"{t.name}: missing")
        elif tuple(meta.size) != t.shape:
            problems.append(f"{t.name}: shape {tuple(meta.size)} in the checkpoint, {t.shape} in the config")
    if problems:
        raise ValueError(
            f"{iter_dir} does not match the model config of {source}: "
            + "; ".join(problems[:5])
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        )

    writer = ShardWriter(fresh_tmp(final), max_shard_bytes)
    for group in _groups_by_bytes(tensors, stored, max_shard_bytes):
        state = {
            "model": {
                t.name: torch.empty(t.shape, dtype=stored[f"model.{t.name}"].properties.dtype) for t in group
            }
        }
        dcp.load(state, checkpoint_id=str(iter_dir), no_dist=True)
        for t in group:
            value = state["model"][t.name]
            writer.add(t.name, value.to(out_dtype) if value.is_floating_point() else value)
    num_shards = writer.finish()
    copy_metadata(source, writer.out, out_dtype)
    commit_dir(writer.out, final)
    logger.info("converted %s -> %s (%d shards, %s)", iter_dir, final, num_shards, dtype_name(out_dtype))
    return final


def _groups_by_bytes(
    tensors: list[_Tensor], stored: dict[str, StorageMeta], max_bytes: int
) -> list[list[_Tensor]]:
    groups: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        meta = stored[f"model.{t.name}"]
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups
