"""Bucketed weight refit from FSDP2 training ranks to SGLang-protocol rollout engines.

`iter_weight_buckets` walks the model's tensors that a HF checkpoint holds in buckets of at most ``bucket_bytes``,
casts them to the engine dtype and yields each bucket's full tensors. The FSDP2 shards of a bucket travel in one
all-gather of a flat buffer (not one collective per tensor). Collective: every rank walks the same plan in the
same order. Only one bucket of full tensors exists at a time. `row_copies` is the gather-free alternative for
destinations every rank can write (a shared-memory weight window): each rank writes its own shard rows.

`WeightUpdater` is what the trainer refits through, built from a `RefitSetup` (engines, ranks per engine, this
rank, key, deadline, checksum check); each transport implements `_refit` over `stream_buckets`.

`ColocatedWeightUpdater` (engines on the same devices as the training ranks): engine ``e`` is served by training
ranks ``e * ranks_per_engine ... (e + 1) * ranks_per_engine - 1`` (one per engine TP rank). For every bucket each
of those ranks turns its gathered tensors into a tensor-handle string (CUDA IPC / shared memory, see
`miles.utils.serialization`), the engine's leader rank collects the strings in TP order and POSTs them to
``/update_weights_from_tensor``. All ranks then agree on success before the next bucket, which also keeps every
rank's tensors alive until the engine has answered.

`miles.backends.fsdp_utils.broadcast_refit.DistributedWeightUpdater` (engines on other devices/nodes) streams the
same buckets by broadcast over a side process group.

Both follow SGLang 0.5.23's contract (docs/sglang-contract.md): every refit runs inside a weight-update session,
``/begin_weight_update`` on every engine before the first bucket and ``/end_weight_update`` after the last, also
when a bucket failed; no bucket (and so no collective) starts before every engine opened its session. After the
session each engine must report the new ``weight_version`` (``/model_info``), and with ``check_equal`` its
per-tensor checksums (``/weights_checker``) must equal the trainer's.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from miles.backends.fsdp_utils.engine_client import begin_sessions, end_sessions, verify_refit
from miles.utils.engine_http import bearer, post_engine
from miles.utils.progress import track
from miles.utils.serialization import serialize, share_named_tensors
from miles.utils.weight_checksum import tensor_checksum

logger = logging.getLogger(__name__)

# Wrapper prefixes that activation checkpointing, torch.compile and FSDP1 insert into parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """Strip wrapper prefixes so ``name`` matches the HF state-dict key."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class _Entry:
    name: str
    tensor: torch.Tensor  # a DTensor shard or a plain tensor (buffers, unsharded models)
    nbytes: int  # size of the full tensor in the output dtype


def _hf_tensors(model: nn.Module, dtype: torch.dtype | None) -> list[_Entry]:
    """Persistent tensors of ``model`` in state-dict order, tied tensors once (under their first name)."""
    entries, seen = [], set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * out_dtype.itemsize
        entries.append(_Entry(hf_name(name), t, nbytes))
    return entries


def plan_weight_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[str]]:
    """Names per bucket, from metadata only (no communication). A tensor larger than ``bucket_bytes`` gets a
    bucket of its own; otherwise tensors are packed greedily in state-dict order."""
    return [[e.name for e in bucket] for bucket in _plan(_hf_tensors(model, dtype), bucket_bytes)]


def _plan(entries: list[_Entry], bucket_bytes: int) -> list[list[_Entry]]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0 (--update-weight-buffer-size)")
    buckets: list[list[_Entry]] = []
    current: list[_Entry] = []
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


def _full_tensor(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
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
def _gather_bucket(bucket: list[_Entry], dtype: torch.dtype | None) -> Bucket:
    """The full tensors of one bucket, in its order. Row-sharded DTensors on one mesh share one all-gather
    (`_gather_rows`); everything else goes through `_full_tensor` one by one, in the bucket's order (collective
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
    return [(e.name, full[i] if i in full else _full_tensor(e.tensor, dtype)) for i, e in enumerate(bucket)]


@dataclass(frozen=True)
class RefitJob:
    """One refit: every weight of ``model``, cast to ``dtype`` (None: as it is), in buckets of at most
    ``bucket_bytes``, to be served as ``weight_version``."""

    model: nn.Module
    bucket_bytes: int
    weight_version: str
    dtype: torch.dtype | None = None


def stream_buckets(
    job: RefitJob, checksums: dict[str, str] | None, send: Callable[[Bucket, int, bool], None]
) -> int:
    """Gather every bucket (collective: every rank calls this), add its tensors' checksums to ``checksums`` when
    given, and hand it to ``send(bucket, index, is_last)``; only one bucket of full tensors is alive at a time.
    Returns the number of buckets."""
    plan = _plan(_hf_tensors(job.model, job.dtype), job.bucket_bytes)
    buckets = (_gather_bucket(entries, job.dtype) for entries in plan)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    progress = track(buckets, len(plan), f"refit {job.weight_version}", unit="bucket", enabled=rank0)
    for index, bucket in enumerate(progress):
        if checksums is not None:
            checksums.update((name, tensor_checksum(t)) for name, t in bucket)
        send(bucket, index, index == len(plan) - 1)
        del bucket  # freed before the next gather
    return len(plan)


def iter_weight_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``[(hf_name, full_tensor), ...]`` buckets of at most ``bucket_bytes`` (cast to ``dtype``).

    Collective when the model is sharded: every rank must consume the iterator to the end, in step.
    """
    for entries in _plan(_hf_tensors(model, dtype), bucket_bytes):
        yield _gather_bucket(entries, dtype)


@torch.no_grad()  # DTensor.to_local: a plain view
def row_copies(
    entries: list[_Entry],
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
      DTensor is gathered with `_full_tensor` first, which is collective: every rank calls this with the same
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
            full = _full_tensor(t, dtype)
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


@dataclass(frozen=True)
class RefitSetup:
    """What every refit transport is built from: the engines (in order), the training ranks per engine (the
    engine TP size), this process's ``rank`` and ``world_size`` in ``group`` (None: the default group), the
    engines' API key, the deadline of each engine call, and whether to compare per-tensor checksums after each
    refit (``check_equal``)."""

    engine_urls: list[str]
    ranks_per_engine: int
    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    check_equal: bool = False

    def __post_init__(self) -> None:
        if self.ranks_per_engine < 1:
            raise ValueError(f"ranks_per_engine={self.ranks_per_engine}: must be >= 1 (the engine TP size)")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0")


class WeightUpdater(ABC):
    """A refit transport. `update` pushes every weight of a model to the engines (or to some of them, e.g.
    restarted ones) inside a weight-update session and verifies them; it is collective over the training ranks,
    which all raise together on any failure. `engines_restarted` tells it which engines are new processes."""

    def __init__(self, setup: RefitSetup) -> None:
        self.engine_urls = [u.rstrip("/") for u in setup.engine_urls]
        self.ranks_per_engine = setup.ranks_per_engine
        self.rank, self.world_size = setup.rank, setup.world_size
        self.timeout_s, self.check_equal = setup.timeout_s, setup.check_equal
        self._headers = bearer(setup.api_key)
        group = setup.group
        self._global = [
            dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)
        ]
        # Control plane on gloo: strings and flags travel on CPU whatever the training backend is.
        # new_group is collective over the default group: every rank creates every group, in the same order.
        self._ctrl = dist.new_group(self._global, backend="gloo")

    def update(
        self,
        model: nn.Module,
        bucket_bytes: int,
        weight_version: str,
        dtype: torch.dtype | None = None,
        engines: list[str] | None = None,
    ) -> int:
        """Push all weights of ``model`` (cast to ``dtype``, in buckets of at most ``bucket_bytes``) to
        ``engines`` (None: all) as ``weight_version``, then verify them; returns the number of buckets."""
        return self._refit(RefitJob(model, bucket_bytes, weight_version, dtype), self._targets(engines))

    @abstractmethod
    def _refit(self, job: RefitJob, targets: list[str]) -> int:
        """Push ``job`` to ``targets`` (some of the engines, in their order); returns the number of buckets."""

    def engines_restarted(self, urls: list[str]) -> None:
        """Engines that were restarted (new processes); by default nothing to redo (checked to be ours)."""
        self._targets(urls)

    def _targets(self, engines: list[str] | None) -> list[str]:
        """The engines a refit goes to (None: all), in this updater's order; each must be one of ours."""
        if engines is None:
            return list(self.engine_urls)
        wanted = {u.rstrip("/") for u in engines}
        unknown = sorted(wanted - set(self.engine_urls))
        if unknown:
            raise ValueError(f"engines {unknown} are not among this updater's {self.engine_urls}")
        return [u for u in self.engine_urls if u in wanted]

    def run_agreed(self, here: bool, fn: Callable[[], object]) -> None:
        """Run ``fn`` where ``here`` holds; every rank learns every rank's error and all raise together."""
        error = None
        if here:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported to every rank below, so none hangs
                error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        self._raise_if_any_failed(error)

    def _raise_if_any_failed(self, error: str | None) -> None:
        raise_if_any_failed(error, self.world_size, self._ctrl)


class ColocatedWeightUpdater(WeightUpdater):
    """Refit colocated engines through tensor handles, bucket by bucket (see the module docstring)."""

    def __init__(self, setup: RefitSetup) -> None:
        n_engines, per_engine = len(setup.engine_urls), setup.ranks_per_engine
        max_engines = setup.world_size // per_engine
        if n_engines > max_engines:
            raise ValueError(
                f"{n_engines} colocated engines need {n_engines * per_engine} training ranks "
                f"({per_engine} per engine), but world_size={setup.world_size}: at most {max_engines} engines"
            )
        super().__init__(setup)
        self._engine_groups = [
            dist.new_group(self._global[e * per_engine : (e + 1) * per_engine], backend="gloo")
            for e in range(n_engines)
        ]
        e = self.rank // per_engine
        self.engine_index: int | None = e if e < n_engines else None
        self.is_leader = self.engine_index is not None and self.rank % per_engine == 0

    def _url_if_targeted(self, targets: list[str]) -> str | None:
        """Our engine's URL when this rank serves it and it is one of ``targets``, else None."""
        if self.engine_index is None or self.engine_urls[self.engine_index] not in targets:
            return None
        return self.engine_urls[self.engine_index]

    def _refit(self, job: RefitJob, targets: list[str]) -> int:
        version = job.weight_version
        targeted = self._url_if_targeted(targets)
        url = targeted if self.is_leader else None
        self.run_agreed(
            self.is_leader, lambda: url and begin_sessions([url], self._headers, self.timeout_s, version)
        )
        checksums: dict[str, str] | None = {} if self.check_equal and self.is_leader else None

        def send(bucket: Bucket, index: int, is_last: bool) -> None:
            self.run_agreed(targeted is not None, lambda: self._send_bucket(bucket, index, is_last, version))

        try:
            n_buckets = stream_buckets(job, checksums, send)
        finally:
            self.run_agreed(
                self.is_leader, lambda: url and end_sessions([url], self._headers, self.timeout_s, version)
            )
        self.run_agreed(
            self.is_leader,
            lambda: url and verify_refit([url], version, self._headers, self.timeout_s, checksums),
        )
        return n_buckets

    def _send_bucket(self, bucket: Bucket, index: int, is_last: bool, weight_version: str) -> None:
        if self.engine_index is None:
            return
        payload = serialize(share_named_tensors(bucket))
        group = self._engine_groups[self.engine_index]
        leader = self._global[self.engine_index * self.ranks_per_engine]
        gathered: list[str] | None = [None] * self.ranks_per_engine if self.is_leader else None
        dist.gather_object(payload, gathered, dst=leader, group=group)
        if self.is_leader:
            self._post(self.engine_urls[self.engine_index], index, gathered, is_last, weight_version)

    def _post(self, url: str, index: int, payloads: list[str], is_last: bool, weight_version: str) -> None:
        body = {
            "serialized_named_tensors": payloads,
            "load_format": None,
            "flush_cache": is_last,
            "weight_version": weight_version,
        }
        post_engine(
            url,
            "update_weights_from_tensor",
            body,
            self._headers,
            self.timeout_s,
            f"refit {weight_version}, bucket {index}",
        )


def raise_if_any_failed(error: str | None, world_size: int, group: dist.ProcessGroup) -> None:
    """Collective: every rank learns every rank's error (None: fine) and all raise together, so none hangs.

    ``group`` must be a gloo group (CPU tensors). The common case costs one all-reduce of a flag (a fraction of
    the two collectives and the pickling of `all_gather_object`); only when some rank failed do all ranks, which
    all saw the flag, exchange their messages."""
    errors: list[str | None] = [error]
    if world_size > 1:  # one rank alone has nobody to tell: no collective
        flag = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag.item():
            return
        errors = [None] * world_size
        dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e is not None]
    if failed:
        raise RuntimeError("weight update failed: " + " | ".join(failed))
