"""The weights a refit sends, planned into buckets and gathered: what every transport of `miles.refit` streams.

`hf_tensors` lists the tensors of a refit source (the model, or a LoRA model's merged view: anything with a
``state_dict(keep_vars=True)``, see `RefitSource`) that a HF checkpoint holds, under their HF names, tied tensors
once. `plan_buckets` packs them into buckets of at most ``bucket_bytes`` in the engine dtype. `stream_buckets` and
`iter_weight_buckets` gather each bucket's full tensors: the FSDP2 shards of a bucket travel in one all-gather of a
flat buffer (not one collective per tensor). Collective: every rank walks the same plan in the same order. Only one
bucket of full tensors exists at a time. `row_copies` is the gather-free alternative for destinations every rank
can write (a shared-memory weight window, `miles.refit.window`): each rank writes its own shard rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from miles.refit.fp8 import quantize_bucket
from miles.refit.moe_names import split_bucket
from miles.refit.vl_names import engine_name
from miles.utils.progress import track

if TYPE_CHECKING:
    from miles.refit.checksums import RefitChecksums


class RefitSource(Protocol):
    """What a refit reads: an ``nn.Module``, or a stand-in with the same state dict under the HF names (the
    trainer's LoRA merged view). Its values are tensors or lazy stand-ins with ``dtype``, ``shape``, ``numel()``,
    ``is_floating_point()`` and a ``detach()`` that makes the tensor."""

    def state_dict(self, *, keep_vars: bool = ...) -> Mapping[str, Any]: ...


# Wrapper prefixes that activation checkpointing, torch.compile and FSDP1 insert into parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """Strip wrapper prefixes so ``name`` matches the HF state-dict key."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def sent_name(name: str) -> str:
    """The name a refit sends: the HF key, in the spelling SGLang's VL loaders take (``miles.refit.vl_names``)."""
    return engine_name(hf_name(name))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor a refit sends, under its HF name, with the size it has in the engine dtype."""

    name: str
    tensor: torch.Tensor  # a DTensor shard or a plain tensor (buffers, unsharded models)
    nbytes: int  # size of the full tensor in the output dtype


def hf_tensors(
    model: RefitSource, dtype: torch.dtype | None, rename: Callable[[str], str] = sent_name
) -> list[TensorEntry]:
    """Persistent tensors of ``model`` in state-dict order, tied tensors once (under their first name), named by
    ``rename`` (default: the names a refit sends; `hf_name` gives transformers' own keys, for an HF export)."""
    entries, seen = [], set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * out_dtype.itemsize
        entries.append(TensorEntry(rename(name), t, nbytes))
    return entries


def plan_weight_buckets(
    model: RefitSource, bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[str]]:
    """Names per bucket, from metadata only (no communication). A tensor larger than ``bucket_bytes`` gets a
    bucket of its own; otherwise tensors are packed greedily in state-dict order."""
    return [[e.name for e in bucket] for bucket in plan_buckets(hf_tensors(model, dtype), bucket_bytes)]


def plan_buckets(entries: list[TensorEntry], bucket_bytes: int) -> list[list[TensorEntry]]:
    """``entries`` packed greedily, in order, into buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0 (--update-weight-buffer-size)")
    buckets: list[list[TensorEntry]] = []
    current: list[TensorEntry] = []
    size = 0
    for e in entries:
        if current and size + e.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        buckets.append(current)
    return buckets


Bucket = list[tuple[str, torch.Tensor]]  # [(hf_name, full tensor), ...]


def full_tensor(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """All-gather a DTensor (moving a CPU-offloaded shard to the mesh's device first) and cast floats."""
    if isinstance(t, DTensor) and t.device_mesh.size() == 1:
        t = t.to_local()  # one rank holds the whole tensor: no gather, no copy
    elif isinstance(t, DTensor):
        mesh_device = t.device_mesh.device_type
        if t.device.type != mesh_device:
            t = t.to(mesh_device)
        t = t.full_tensor()
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t


def _out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _row_sharded(t: torch.Tensor) -> DTensor | None:
    """``t`` when it is a DTensor sharded along dim 0 over a 1-D mesh of more than one rank (what FSDP2's
    ``fully_shard`` makes), so that its shards can join a bucket's single all-gather; None otherwise."""
    if (
        isinstance(t, DTensor)
        and t.device_mesh.ndim == 1
        and t.device_mesh.size() > 1
        and t.placements == (Shard(0),)
        and t.dim() > 0
    ):
        return t
    return None


_ROWS = (Shard(0),)  # FSDP2's placement on a 1-D mesh

_GATHER_ALIGN = 64  # bytes; every piece of a gather buffer starts aligned, so it can be viewed as any dtype


def _aligned(n: int) -> int:
    return (n + _GATHER_ALIGN - 1) // _GATHER_ALIGN * _GATHER_ALIGN


def _gather_rows(tensors: list[DTensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Full tensors of row-sharded DTensors on one mesh with one all-gather of a flat byte buffer.

    Shard(0) splits dim 0 as ``torch.chunk`` does: rank r holds rows ``[r*c, min(n, (r+1)*c))`` with
    ``c = ceil(n / world)``. Each rank packs its shards (cast to the output dtype) into a slot of equal size, the
    gathered slots are unpacked row block by row block into fresh full tensors. Transient memory: the gathered
    buffer (the bucket's bytes) next to the bucket's full tensors while unpacking."""
    mesh = tensors[0].device_mesh
    world, me = mesh.size(), mesh.get_local_rank()
    device = torch.device(mesh.device_type)
    pieces = []  # (offset in a slot, rows per chunk, bytes per row, out dtype)
    slot = 0
    for t in tensors:
        out_dtype = _out_dtype(t, dtype)
        row_bytes = t.shape[1:].numel() * out_dtype.itemsize
        chunk = -(-t.shape[0] // world)
        pieces.append((slot, chunk, row_bytes, out_dtype))
        slot = _aligned(slot + chunk * row_bytes)
    send = torch.empty(slot, dtype=torch.uint8, device=device)
    for t, (offset, chunk, row_bytes, out_dtype) in zip(tensors, pieces, strict=True):
        local = t.to_local().detach()
        mine = max(0, min(t.shape[0], (me + 1) * chunk) - me * chunk)
        assert local.shape[0] == mine, (
            f"{tuple(t.shape)} over {world} ranks: rank {me} holds {local.shape[0]}"
        )
        if local.numel():
            part = send[offset : offset + local.shape[0] * row_bytes].view(out_dtype).view(local.shape)
            part.copy_(local)  # casts; moves a CPU-offloaded shard to the mesh's device
    gathered = torch.empty(world * slot, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, send, group=mesh.get_group())
    del send
    full = []
    for t, (offset, chunk, row_bytes, out_dtype) in zip(tensors, pieces, strict=True):
        out = torch.empty(t.shape, dtype=out_dtype, device=device)
        n_rows = t.shape[0]
        for r in range(world):
            lo, hi = min(n_rows, r * chunk), min(n_rows, (r + 1) * chunk)
            if hi > lo:
                start = r * slot + offset
                block = gathered[start : start + (hi - lo) * row_bytes].view(out_dtype)
                out[lo:hi].copy_(block.view((hi - lo, *t.shape[1:])))
        full.append(out)
    return full


@torch.no_grad()  # also makes DTensor.to_local a plain view (no autograd node per tensor)
def gather_bucket(bucket: list[TensorEntry], dtype: torch.dtype | None) -> Bucket:
    """The full tensors of one bucket, in its order. Row-sharded DTensors on one mesh share one all-gather
    (`_gather_rows`); everything else goes through `full_tensor` one by one, in the bucket's order (collective
    too: every rank takes the same path for the same tensor)."""
    rows: dict[int, DTensor] = {}  # bucket index -> DTensor
    mesh = None
    for i, e in enumerate(bucket):
        t = _row_sharded(e.tensor)
        if t is not None and (mesh is None or t.device_mesh == mesh):
            mesh = t.device_mesh
            rows[i] = t
    full: dict[int, torch.Tensor] = {}
    if rows:
        full = dict(zip(rows, _gather_rows(list(rows.values()), dtype), strict=True))
    return [(e.name, full[i] if i in full else full_tensor(e.tensor, dtype)) for i, e in enumerate(bucket)]


@dataclass(frozen=True)
class RefitJob:
    """One refit: every weight of ``model``, cast to ``dtype`` (None: as it is), in buckets of at most
    ``bucket_bytes``, to be served as ``weight_version``; with ``fp8_scale_format`` the linear weights are sent
    as block FP8 (each followed by its scales). ``flush_cache``: whether the last bucket's request asks the
    engine to flush its KV cache (False while requests are held by an in_place pause: SGLang fails a flushing
    update then, docs/sglang-contract.md)."""

    model: RefitSource
    bucket_bytes: int
    weight_version: str
    dtype: torch.dtype | None = None
    fp8_scale_format: str | None = None  # block FP8 of the linear weights (`miles.refit.fp8`); None: none
    flush_cache: bool = True  # the last request flushes the KV cache; False under an in_place pause


def stream_buckets(
    job: RefitJob, checksums: RefitChecksums | None, send: Callable[[Bucket, int, bool], None]
) -> int:
    """Gather every bucket (collective: every rank calls this), quantize it when the job says so, send stacked
    MoE experts per expert (`miles.refit.moe_names`; after quantizing: they stay unquantized as before), hash its
    tensors into ``checksums`` when given (no second gather), and hand it to ``send(bucket, index, is_last)``;
    only one bucket of full tensors is alive at a time.
    Returns the number of buckets."""
    plan = plan_buckets(hf_tensors(job.model, job.dtype), job.bucket_bytes)
    buckets = (gather_bucket(entries, job.dtype) for entries in plan)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    progress = track(buckets, len(plan), f"refit {job.weight_version}", unit="bucket", enabled=rank0)
    for index, bucket in enumerate(progress):
        if job.fp8_scale_format is not None:
            bucket = quantize_bucket(bucket, job.fp8_scale_format)
        bucket = split_bucket(bucket)  # stacked experts per expert, as SGLang loads them (moe_names)
        if checksums is not None:
            checksums.add_bucket(bucket)
        send(bucket, index, index == len(plan) - 1)
        del bucket  # freed before the next gather
    return len(plan)


def iter_weight_buckets(
    model: RefitSource, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``[(hf_name, full_tensor), ...]`` buckets of at most ``bucket_bytes`` (cast to ``dtype``), under
    transformers' own state-dict keys (what an HF export writes; a refit renames for SGLang's VL loaders).

    Collective when the model is sharded: every rank must consume the iterator to the end, in step.
    """
    for entries in plan_buckets(hf_tensors(model, dtype, rename=hf_name), bucket_bytes):
        yield gather_bucket(entries, dtype)


@torch.no_grad()  # DTensor.to_local: a plain view
def row_copies(
    entries: list[TensorEntry],
    dtype: torch.dtype | None,
    destinations: list[Mapping[str, torch.Tensor]],
    rank: int,
    world_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(destination, source)`` copies by which this rank writes its share of every tensor of ``entries``
    (cast to ``dtype`` when floating) into the tensor of its name in each of ``destinations`` (tensors of the full
    shape that every rank writes, e.g. views of weight windows in shared memory); once every rank has made its
    copies, the destinations hold the whole tensors (callers agree on that with a collective after):

    - a DTensor row-sharded over all ``world_size`` ranks (what FSDP2 makes): its own shard's rows, straight from
      the shard, without communication;
    - any other tensor with rows: rows ``[r*c, min(n, (r+1)*c))`` of its full tensor, ``c = ceil(n / world)`` (a
      DTensor is gathered with `full_tensor` first, which is collective: every rank calls this with the same
      entries in the same order); a 0-dim tensor: rank 0.

    The values are those a gathered refit sends (the cast to ``dtype`` comes first, then the destination's own
    dtype if it differs), so both paths give the same bytes."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    meshes: dict[int, tuple[int, int]] = {}  # id(mesh) -> (size, this rank's index): DeviceMesh asks are slow
    for e in entries:
        t = e.tensor
        out_dtype = _out_dtype(t, dtype)
        src: torch.Tensor | None = None
        if isinstance(t, DTensor) and t.dim() > 0 and t.placements == _ROWS and t.device_mesh.ndim == 1:
            mesh = t.device_mesh
            if id(mesh) not in meshes:
                meshes[id(mesh)] = (mesh.size(), mesh.get_local_rank())
            size, me = meshes[id(mesh)]
            if size == world_size:
                src, lo = t.to_local(), me * -(-t.shape[0] // size)  # under no_grad: a plain view
        if src is None:
            full = full_tensor(t, dtype)
            if full.dim() == 0:
                if rank == 0:
                    copies.extend((dest[e.name], full) for dest in destinations)
                continue
            chunk = -(-full.shape[0] // world_size)
            lo = min(full.shape[0], rank * chunk)
            src = full[lo : lo + chunk]
        rows = src.shape[0]
        if not rows:
            continue  # an empty shard (more ranks than rows)
        if src.dtype != out_dtype:
            src = src.to(out_dtype)
        whole = lo == 0 and rows == t.shape[0]  # one rank holds all rows: no slicing
        copies.extend((dest[e.name] if whole else dest[e.name][lo : lo + rows], src) for dest in destinations)
    return copies
