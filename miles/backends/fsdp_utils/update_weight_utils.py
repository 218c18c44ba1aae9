"""Bucketed weight refit from FSDP2 training ranks to SGLang-protocol rollout engines.

`iter_weight_buckets` walks the model's tensors that a HF checkpoint holds, all-gathers each sharded tensor
(a collective: every rank walks the same plan in the same order), casts it to the engine dtype and yields buckets
of at most ``bucket_bytes``. Only one bucket of full tensors exists at a time.

`ColocatedWeightUpdater` (engines on the same devices as the training ranks): engine ``e`` is served by training
ranks ``e * ranks_per_engine ... (e + 1) * ranks_per_engine - 1`` (one per engine TP rank). For every bucket each
of those ranks turns its gathered tensors into a tensor-handle string (CUDA IPC / shared memory, see
`miles.utils.serialization`), the engine's leader rank collects the strings in TP order and POSTs them to
``/update_weights_from_tensor``. All ranks then agree on success before the next bucket, which also keeps every
rank's tensors alive until the engine has answered.

`DistributedWeightUpdater` (engines on other devices/nodes): training rank 0 and every engine rank form a separate
process group (``/init_weights_update_group``); per bucket, rank 0 announces names/dtypes/shapes
(``/update_weights_from_distributed``) and broadcasts the tensors in that order.

Both follow SGLang 0.5.23's contract (docs/sglang-contract.md): every refit runs inside a weight-update session,
``/begin_weight_update`` on every engine before the first bucket and ``/end_weight_update`` after the last, also
when a bucket failed; no bucket (and so no collective) starts before every engine opened its session. After the
session each engine must report the new ``weight_version`` (``/model_info``), and with ``check_equal`` its
per-tensor checksums (``/weights_checker``) must equal the trainer's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.engine_client import (
    begin_sessions,
    compare_checksums,
    end_sessions,
    engine_checksums,
    post_engine,
    verify_versions,
)
from miles.utils.net import free_port
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


def _buckets_with_progress(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None, n_buckets: int, weight_version: str
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`iter_weight_buckets` under a progress bar over the buckets (drawn by global rank 0 only)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    buckets = iter_weight_buckets(model, bucket_bytes, dtype)
    return track(buckets, n_buckets, f"refit {weight_version}", unit="bucket", enabled=rank0)


def iter_weight_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``[(hf_name, full_tensor), ...]`` buckets of at most ``bucket_bytes`` (cast to ``dtype``).

    Collective when the model is sharded: every rank must consume the iterator to the end, in step.
    """
    for bucket in _plan(_hf_tensors(model, dtype), bucket_bytes):
        yield [(e.name, _full_tensor(e.tensor, dtype)) for e in bucket]


class ColocatedWeightUpdater:
    """Refit colocated engines through tensor handles, bucket by bucket (see the module docstring).

    ``rank``/``world_size`` are this process's rank and size in ``group`` (None: the default group).
    """

    def __init__(
        self,
        engine_urls: list[str],
        ranks_per_engine: int,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        check_equal: bool = False,
    ) -> None:
        if ranks_per_engine < 1:
            raise ValueError(f"ranks_per_engine={ranks_per_engine}: must be >= 1 (the engine TP size)")
        max_engines = world_size // ranks_per_engine
        if len(engine_urls) > max_engines:
            raise ValueError(
                f"{len(engine_urls)} colocated engines need {len(engine_urls) * ranks_per_engine} training ranks "
                f"({ranks_per_engine} per engine), but world_size={world_size}: at most {max_engines} engines"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.ranks_per_engine = ranks_per_engine
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.check_equal = check_equal
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(world_size)]
        # Control-plane groups on gloo: strings and flags travel on CPU whatever the training backend is.
        # new_group is collective over the default group: every rank creates every group, in the same order.
        self._ctrl = dist.new_group(self._global, backend="gloo")
        self._engine_groups = [
            dist.new_group(self._global[e * ranks_per_engine : (e + 1) * ranks_per_engine], backend="gloo")
            for e in range(len(engine_urls))
        ]
        e = rank // ranks_per_engine
        self.engine_index: int | None = e if e < len(engine_urls) else None
        self.is_leader = self.engine_index is not None and rank % ranks_per_engine == 0

    def engines_restarted(self, urls: list[str]) -> None:
        """Engines that were restarted (new processes): handles travel with every bucket, nothing to redo."""
        self._targets(urls)

    def _targets(self, engines: list[str] | None) -> set[str]:
        """The engines a refit goes to (None: all); each must be one of ours."""
        if engines is None:
            return set(self.engine_urls)
        targets = {u.rstrip("/") for u in engines}
        unknown = sorted(targets - set(self.engine_urls))
        if unknown:
            raise ValueError(f"engines {unknown} are not among this updater's {self.engine_urls}")
        return targets

    def _url_if_targeted(self, engines: list[str] | None) -> str | None:
        """Our engine's URL when this rank is its leader and it is a target of this refit, else None."""
        targets = self._targets(engines)
        if self.engine_index is None or self.engine_urls[self.engine_index] not in targets:
            return None
        return self.engine_urls[self.engine_index]

    def update(
        self,
        model: nn.Module,
        bucket_bytes: int,
        weight_version: str,
        dtype: torch.dtype | None = None,
        engines: list[str] | None = None,
    ) -> int:
        """Push all weights of ``model`` to the engines (``engines``: a subset, e.g. restarted ones; None: all)
        inside a weight-update session, then verify them; returns the number of buckets. Collective: every rank
        raises together on any failure."""
        n_buckets = len(_plan(_hf_tensors(model, dtype), bucket_bytes))
        targeted = self._url_if_targeted(engines)
        url = targeted if self.is_leader else None
        self._on_leaders(lambda: url and begin_sessions([url], self._headers, self.timeout_s, weight_version))
        checksums: dict[str, str] = {}
        try:
            for index, bucket in enumerate(
                _buckets_with_progress(model, bucket_bytes, dtype, n_buckets, weight_version)
            ):
                if self.check_equal and self.is_leader:
                    checksums.update((name, tensor_checksum(t)) for name, t in bucket)
                self._on_all(
                    lambda b=bucket, i=index: (
                        self._send_bucket(b, i, i == n_buckets - 1, weight_version)
                        if targeted is not None
                        else None
                    )
                )
                del bucket
        finally:
            self._on_leaders(
                lambda: url and end_sessions([url], self._headers, self.timeout_s, weight_version)
            )
        self._on_leaders(lambda: url and self._verify(url, weight_version, checksums))
        return n_buckets

    def _verify(self, url: str, version: str, checksums: dict[str, str]) -> None:
        verify_versions([url], version, self._headers, self.timeout_s)
        if self.check_equal:
            engine = engine_checksums(url, self._headers, self.timeout_s, version)
            compare_checksums(url, checksums, engine, version)

    def _on_all(self, fn: Callable[[], None]) -> None:
        error = None
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, so none hangs
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        self._raise_if_any_failed(error)

    def _on_leaders(self, fn: Callable[[], object]) -> None:
        self._on_all(lambda: fn() if self.is_leader else None)

    def _send_bucket(
        self, bucket: list[tuple[str, torch.Tensor]], index: int, is_last: bool, weight_version: str
    ) -> None:
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

    def _raise_if_any_failed(self, error: str | None) -> None:
        raise_if_any_failed(error, self.world_size, self._ctrl)


def _wait_fail_fast(done: Callable[[], bool], answers: list[Future], timeout_s: float, what: str) -> None:
    """Wait until ``done()``, failing at once when an engine's answer in ``answers`` is an error (a refusing
    engine never joins the collective, which would otherwise wait for the whole group timeout)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not done():
        for f in answers:
            if f.done() and f.exception() is not None:
                raise RuntimeError(f"{what}: {f.exception()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done within {timeout_s:.0f} s (an engine did not take part)")
        time.sleep(0.005)


def raise_if_any_failed(error: str | None, world_size: int, group: dist.ProcessGroup) -> None:
    """Collective: every rank learns every rank's error (None: fine) and all raise together, so none hangs."""
    errors: list[str | None] = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e is not None]
    if failed:
        raise RuntimeError("weight update failed: " + " | ".join(failed))


def init_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join a process group that is independent of the default one (trainer rank 0 + every engine rank).

    Same construction as SGLang's engine side of ``/init_weights_update_group``: TCP rendezvous at
    ``tcp://master_address:master_port`` (hosted by rank 0), keys namespaced by ``group_name``. Blocks until all
    ``world_size`` members have joined.
    """
    import inspect
    from datetime import timedelta

    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class DistributedWeightUpdater:
    """Disaggregated refit: training rank 0 broadcasts each bucket to the engines over a dedicated group.

    `connect` (once): rank 0 asks every engine to join group ``group_name`` (``/init_weights_update_group``;
    engine ``e``'s TP ranks get ranks ``1 + e * ranks_per_engine ...``) and joins it as rank 0.
    `update`: all training ranks gather each bucket (FSDP collective); rank 0 announces it
    (``/update_weights_from_distributed`` with names, dtypes, shapes) to every engine and broadcasts the
    tensors in that order while the requests are in flight, all inside one weight-update session per refit
    (no broadcast starts before every engine opened it). The broadcasts are asynchronous and watched together
    with the engines' answers: an engine that refuses a bucket fails the refit at once, naming the engine,
    instead of leaving the collective to wait for the group's timeout (``timeout_s``).
    `engines_restarted` + `update(engines=...)`: a restarted engine is a new process outside the group, so the
    group follows the engines a refit goes to: when they differ from the group's members (or a member was
    restarted), the members that still hold the group leave it and a new group forms with the targets (on a
    fresh port; ``master_port`` serves the first group). A refit of the restarted engines alone therefore
    regroups twice: to them, then back to all engines at the next full refit.
    `disconnect` tears the group down (``/destroy_weights_update_group``).
    All are collective over the training ranks (``group``; None: the default group), and all ranks
    raise together on failure.
    """

    def __init__(
        self,
        engine_urls: list[str],
        ranks_per_engine: int,
        rank: int,
        world_size: int,
        master_address: str,
        master_port: int | None = None,
        group: dist.ProcessGroup | None = None,
        group_name: str = "miles_weights_update",
        backend: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        check_equal: bool = False,
    ) -> None:
        if not engine_urls:
            raise ValueError("DistributedWeightUpdater: engine_urls is empty")
        if ranks_per_engine < 1:
            raise ValueError(f"ranks_per_engine={ranks_per_engine}: must be >= 1 (the engine TP size)")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weights-update backend {backend!r}: allowed 'nccl', 'gloo'")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.ranks_per_engine = ranks_per_engine
        self.rank, self.world_size = rank, world_size
        self.master_address, self._next_port = master_address, master_port
        self.group_name, self.backend, self.timeout_s = group_name, backend, timeout_s
        self.check_equal = check_equal
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world_size)]
        self._ctrl = dist.new_group(ranks, backend="gloo")  # collective over the default group
        self._group: dist.ProcessGroup | None = None
        self.members: list[str] = []  # engines in the current group, in rank order
        self._lost: set[str] = set()  # members restarted since they joined (they no longer hold the group)
        # one thread per engine request, plus one for joining the group while the requests wait for it
        self._pool = ThreadPoolExecutor(max_workers=len(engine_urls) + 1, thread_name_prefix="miles-refit")

    @property
    def update_world_size(self) -> int:
        return 1 + len(self.members) * self.ranks_per_engine

    def _post_to(self, urls: list[str], endpoint: str, bodies: list[dict], what: str) -> list[Future]:
        return [
            self._pool.submit(post_engine, url, endpoint, body, self._headers, self.timeout_s, what)
            for url, body in zip(urls, bodies, strict=True)
        ]

    def _on_rank0(self, fn: Callable[[], None]) -> None:
        error = None
        if self.rank == 0:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported to every rank, so none hangs
                error = f"rank 0: {type(exc).__name__}: {exc}"
        raise_if_any_failed(error, self.world_size, self._ctrl)

    def _targets(self, engines: list[str] | None) -> list[str]:
        if engines is None:
            return list(self.engine_urls)
        wanted = {u.rstrip("/") for u in engines}
        unknown = sorted(wanted - set(self.engine_urls))
        if unknown:
            raise ValueError(f"engines {unknown} are not among this updater's {self.engine_urls}")
        return [u for u in self.engine_urls if u in wanted]

    def engines_restarted(self, urls: list[str]) -> None:
        """``urls`` were restarted: they left the group with their old process (the next refit regroups)."""
        self._lost.update(self._targets(urls))

    def connect(self, engines: list[str] | None = None) -> None:
        """Create the update group with ``engines`` (None: all). Collective over the training ranks."""
        if self._group is not None:
            raise RuntimeError(f"weights-update group {self.group_name!r} is already connected")
        targets = self._targets(engines)
        port = self._next_port
        self._next_port = None

        def join() -> None:
            master_port = port or free_port("")  # rank 0 hosts the store: every interface
            world_size = 1 + len(targets) * self.ranks_per_engine
            bodies = [
                {
                    "master_address": self.master_address,
                    "master_port": master_port,
                    "rank_offset": 1 + e * self.ranks_per_engine,
                    "world_size": world_size,
                    "group_name": self.group_name,
                    "backend": self.backend,
                }
                for e in range(len(targets))
            ]
            pending = self._post_to(targets, "init_weights_update_group", bodies, f"group {self.group_name}")
            joining = self._pool.submit(
                init_weights_update_group, self.master_address, master_port, 0,
                world_size, self.group_name, self.backend, self.timeout_s,
            )  # fmt: skip
            _wait_fail_fast(
                lambda: joining.done(), pending, self.timeout_s, f"joining group {self.group_name}"
            )
            self._group = joining.result()
            for f in pending:
                f.result()

        self._on_rank0(join)
        self.members, self._lost = targets, set()

    def update(
        self,
        model: nn.Module,
        bucket_bytes: int,
        weight_version: str,
        dtype: torch.dtype | None = None,
        engines: list[str] | None = None,
    ) -> int:
        """Push all weights of ``model`` inside a weight-update session on every targeted engine (None: all),
        then verify them; returns the number of buckets. Collective over the training ranks."""
        if not self.members:
            raise RuntimeError("DistributedWeightUpdater.update called before connect()")
        targets = self._targets(engines)
        if targets != self.members or self._lost:
            self.disconnect()
            self.connect(targets)
        n_buckets = len(_plan(_hf_tensors(model, dtype), bucket_bytes))
        urls, headers, timeout = self.members, self._headers, self.timeout_s
        self._on_rank0(lambda: begin_sessions(urls, headers, timeout, weight_version))
        checksums: dict[str, str] = {}
        try:
            for index, bucket in enumerate(
                _buckets_with_progress(model, bucket_bytes, dtype, n_buckets, weight_version)
            ):
                if self.check_equal and self.rank == 0:
                    checksums.update((name, tensor_checksum(t)) for name, t in bucket)
                is_last = index == n_buckets - 1
                self._on_rank0(
                    lambda b=bucket, i=index, last=is_last: self._broadcast(b, i, last, weight_version)
                )
        finally:
            self._on_rank0(lambda: end_sessions(urls, headers, timeout, weight_version))
        self._on_rank0(lambda: self._verify(weight_version, checksums))
        return n_buckets

    def _verify(self, version: str, checksums: dict[str, str]) -> None:
        verify_versions(self.members, version, self._headers, self.timeout_s)
        if self.check_equal:
            for url in self.members:
                engine = engine_checksums(url, self._headers, self.timeout_s, version)
                compare_checksums(url, checksums, engine, version)

    def _broadcast(
        self, bucket: list[tuple[str, torch.Tensor]], index: int, is_last: bool, version: str
    ) -> None:
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": is_last,
            "weight_version": version,
        }
        pending = self._post_to(
            self.members, "update_weights_from_distributed", [body] * len(self.members), f"bucket {index}"
        )
        works = [
            dist.broadcast(t.contiguous(), group=self._group, group_src=0, async_op=True) for _, t in bucket
        ]
        _wait_fail_fast(
            lambda: all(w.is_completed() for w in works),
            pending,
            self.timeout_s,
            f"broadcast of bucket {index}",
        )
        for w in works:
            w.wait()
        for f in pending:
            f.result()

    def disconnect(self) -> None:
        """Ask the members that still hold the group to leave it and destroy our side. Collective over the
        training ranks."""
        holding = [u for u in self.members if u not in self._lost]

        def leave() -> None:
            if self._group is None:
                return
            bodies = [{"group_name": self.group_name}] * len(holding)
            for f in self._post_to(
                holding, "destroy_weights_update_group", bodies, f"group {self.group_name}"
            ):
                f.result()
            dist.destroy_process_group(self._group)
            self._group = None

        self._on_rank0(leave)
        self.members, self._lost = [], set()
