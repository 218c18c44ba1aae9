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
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from miles.utils.serialization import serialize, share_named_tensors

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
    if isinstance(t, DTensor):
        mesh_device = t.device_mesh.device_type
        if t.device.type != mesh_device:
            t = t.to(mesh_device)
        t = t.full_tensor()
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t


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

    def update(
        self, model: nn.Module, bucket_bytes: int, weight_version: str, dtype: torch.dtype | None = None
    ) -> int:
        """Push all weights of ``model`` to the engines; returns the number of buckets. Collective."""
        n_buckets = len(_plan(_hf_tensors(model, dtype), bucket_bytes))
        for index, bucket in enumerate(iter_weight_buckets(model, bucket_bytes, dtype)):
            error = None
            try:
                self._send_bucket(
                    bucket, index, is_last=index == n_buckets - 1, weight_version=weight_version
                )
            except Exception as exc:  # noqa: BLE001 - reported to every rank below, so none hangs
                error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            self._raise_if_any_failed(error)
            del bucket
        return n_buckets

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
        where = f"engine {url}, bucket {index}"
        try:
            resp = httpx.post(
                f"{url}/update_weights_from_tensor", json=body, headers=self._headers, timeout=self.timeout_s
            )
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{where}, phase request: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise RuntimeError(f"{where}, phase status: HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            answer = resp.json()
        except ValueError as exc:
            raise RuntimeError(f"{where}, phase response: not JSON: {resp.text[:500]!r}") from exc
        if not answer.get("success", False):
            raise RuntimeError(f"{where}, phase response: success=false: {answer.get('message', answer)}")

    def _raise_if_any_failed(self, error: str | None) -> None:
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self._ctrl)
        failed = [e for e in errors if e is not None]
        if failed:
            raise RuntimeError("weight update failed: " + " | ".join(failed))


class DistributedWeightUpdater:
    """Disaggregated refit (NCCL broadcast via init_weights_update_group / update_weights_from_distributed)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            "disaggregated weight update (init_weights_update_group + update_weights_from_distributed) is not "
            "built yet; use colocated mode (ColocatedWeightUpdater) or refit from disk"
        )
