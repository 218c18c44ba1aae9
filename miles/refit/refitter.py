"""The refit's one entry point: `make_refitter` builds a `Refitter`, and `Refitter.update` pushes the trainer's
weights to the rollout engines (what a training rank calls after each train step; waking and sleeping the model
around it is the trainer's business).

The transport is chosen at the first update, from --update-weight-transfer-mode (`resolve_transfer_mode`) and the
engines themselves: tensor handles (CUDA IPC / shared memory, `miles.refit.tensor_handles`; a shared-memory weight
window when colocated on CPU and every engine is embedded, `miles.refit.window`) or a broadcast group (NCCL on
GPU, gloo on CPU, `miles.refit.broadcast`). It is kept for the run: a later update to some engines only (the
restarted ones, under fault tolerance) tells it which engines are new processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles.refit.broadcast import DistributedWeightUpdater
from miles.refit.buckets import RefitSource
from miles.refit.engine_endpoints import engine_hash_kind, engines_have_windows
from miles.refit.session import RefitSetup, WeightUpdater
from miles.refit.tensor_handles import ColocatedWeightUpdater
from miles.refit.window import WindowWeightUpdater
from miles.utils.engine_control_http import EngineMemoryControl, bearer

if TYPE_CHECKING:
    from miles.config import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefitSettings:
    """What a refit reads from the run's configuration."""

    transfer_mode: str  # --update-weight-transfer-mode: auto, tensor or broadcast
    colocate: bool  # --colocate: engines on the training devices
    ranks_per_engine: int  # --rollout-num-gpus-per-engine (the engine TP size)
    bucket_bytes: int  # --update-weight-buffer-size
    api_key: str | None  # --engine-api-key
    timeout_s: float  # deadline of each engine call of a refit (below the driver's wait: the engine is named)
    check_equal: bool  # --check-weight-update-equal (default on): per-TP-rank checksums after each refit
    resume_timeout_s: float  # --rollout-request-timeout: the deadline of resuming engine memory
    delta: str = "none"  # --update-weight-delta: none or changed (broadcast only, `miles.refit.delta`)
    fp8_scale_format: str | None = None  # --rollout-weight-quantization fp8: --rollout-fp8-scale-format

    @classmethod
    def from_config(cls, cfg: Config) -> RefitSettings:
        return cls(
            transfer_mode=cfg.train.update_weight_transfer_mode,
            colocate=cfg.cluster.colocate,
            ranks_per_engine=cfg.cluster.rollout_num_gpus_per_engine,
            bucket_bytes=cfg.train.update_weight_buffer_size,
            api_key=cfg.engine.engine_api_key,
            timeout_s=cfg.train.refit_timeout,
            check_equal=cfg.engine.check_weight_update_equal,
            resume_timeout_s=float(cfg.rollout.rollout_request_timeout),
            delta=cfg.train.update_weight_delta,
            fp8_scale_format=(
                cfg.engine.rollout_fp8_scale_format
                if cfg.engine.rollout_weight_quantization == "fp8"
                else None
            ),
        )


def resolve_transfer_mode(
    mode: str,
    colocate: bool,
    is_cuda: bool,
    n_engines: int = 1,
    ranks_per_engine: int = 1,
    world_size: int = 1,
) -> str:
    """--update-weight-transfer-mode resolved: auto is tensor when colocated or on CPU (shared memory, which any
    process on this node can map), broadcast when disaggregated on GPU. Tensor handles give each engine training
    ranks of its own (`miles.refit.tensor_handles`), so disaggregated on CPU with more engines than that
    (1 trainer + 2 engines), auto broadcasts over gloo instead."""
    if mode != "auto":
        return mode
    if colocate:
        return "tensor"
    fits = n_engines * ranks_per_engine <= world_size
    return "tensor" if not is_cuda and fits else "broadcast"


class Refitter:
    """One training rank's refit: collective over the training ranks (every rank calls `update` with the same
    arguments), all raising together on any failure."""

    def __init__(
        self, settings: RefitSettings, rank: int, world_size: int, is_cuda: bool, dtype: torch.dtype | None
    ) -> None:
        self.settings = settings
        self.rank, self.world_size, self.is_cuda, self.dtype = rank, world_size, is_cuda, dtype
        self.transport: WeightUpdater | None = None  # built at the first update

    def transfer_mode(self, n_engines: int) -> str:
        s = self.settings
        return resolve_transfer_mode(
            s.transfer_mode, s.colocate, self.is_cuda, n_engines, s.ranks_per_engine, self.world_size
        )

    def update(
        self,
        source: RefitSource,
        version: str,
        engine_urls: list[str],
        resume_tags: Sequence[str] = (),
        flush_cache: bool = True,
    ) -> int:
        """Refit ``engine_urls`` with ``source``'s weights (cast to the refitter's dtype) as ``version``: every
        engine, or (fault tolerance) the engines that were restarted since the last refit, whose transport (update
        group, window mapping) is new. ``resume_tags``: first resumed on every engine (by rank 0, or through a
        weight window by the rank serving each engine, `WeightUpdater.resume_engines`), all ranks raising the
        error, so none refits alone. ``flush_cache``: False when the engines hold requests paused
        in place (`--pause-generation-mode in_place`: SGLang fails a flushing update then). Returns the number
        of buckets."""
        urls = [u.rstrip("/") for u in engine_urls]
        if self.transport is None:
            self.transport = self._make_transport(urls)
        transport = self.transport
        if resume_tags:
            tags = list(resume_tags)
            transport.resume_engines(
                urls, lambda targets: self._engine_memory(targets).resume_memory(tags), tags
            )
        if urls != transport.engine_urls:
            transport.engines_restarted(urls)
        return transport.update(
            source,
            self.settings.bucket_bytes,
            version,
            dtype=self.dtype,
            engines=urls,
            flush_cache=flush_cache,
        )

    def metrics(self) -> dict[str, float]:
        """The last refit's ``perf/refit_*`` on this rank, else {}: bytes and tensors sent where the transport
        counts them (the broadcast's rank 0, `miles.refit.delta`), and the checksum cost where it compared
        (rank 0): ``perf/refit_checksum_s`` = hashing what was sent (``..._trainer_s``) + waiting for the
        engines' checksums (``..._engine_s``)."""
        if self.transport is None:
            return {}
        out = dict(getattr(self.transport, "last_metrics", {}))
        checks = self.transport.checks
        if checks is not None:
            out["perf/refit_checksum_s"] = checks.seconds + checks.engine_seconds
            out["perf/refit_checksum_trainer_s"] = checks.seconds
            out["perf/refit_checksum_engine_s"] = checks.engine_seconds
        return out

    def _engine_memory(self, urls: list[str]) -> EngineMemoryControl:
        return EngineMemoryControl(urls, self.settings.api_key, self.settings.resume_timeout_s)

    def _make_transport(self, urls: list[str]) -> WeightUpdater:
        """The transport of `transfer_mode` (see the module docstring). Collective."""
        s = self.settings
        setup = RefitSetup(
            urls,
            ranks_per_engine=s.ranks_per_engine,
            rank=self.rank,
            world_size=self.world_size,
            api_key=s.api_key,
            timeout_s=s.timeout_s,
            check_equal=s.check_equal,
            fp8_scale_format=s.fp8_scale_format,
            checksum_kind=self._engines_hash_kind(urls) if s.check_equal else "sha256",
        )
        if self.transfer_mode(len(urls)) == "tensor":
            if s.delta != "none" and self.rank == 0:
                logger.warning(
                    "--update-weight-delta %s: the refit goes through tensor handles, every tensor "
                    "is sent (a delta is for the broadcast transport)",
                    s.delta,
                )
            # a window shares the trainer's own values: FP8 rollout goes through tensor handles instead
            window = s.colocate and not self.is_cuda and s.fp8_scale_format is None
            if window and self._all_engines_have_windows(urls):
                return WindowWeightUpdater(setup)
            return ColocatedWeightUpdater(setup)
        # rank 0 hosts the update group; MASTER_ADDR is its node's address (what the engines can reach)
        address: list[str | None] = [os.environ["MASTER_ADDR"] if self.rank == 0 else None]
        dist.broadcast_object_list(address, src=0)
        assert address[0] is not None
        backend = "nccl" if self.is_cuda else "gloo"
        updater = DistributedWeightUpdater(setup, address[0], backend=backend, delta=s.delta)
        updater.connect()
        return updater

    def _engines_hash_kind(self, urls: list[str]) -> str:
        """The engines' checksum kind (by the device the first one runs on; default: where this trainer runs):
        rank 0 asks, all ranks get the answer (a collective)."""
        answer: list[str | None] = [None]
        if self.rank == 0:
            default = "cuda" if self.is_cuda else "sha256"
            headers = bearer(self.settings.api_key)
            try:
                answer = [engine_hash_kind(urls[0], headers, self.settings.timeout_s, default)]
            except Exception:  # noqa: BLE001 - every rank waits for the answer; the refit names a broken engine
                answer = [default]
        dist.broadcast_object_list(answer, src=0)
        return str(answer[0])

    def _all_engines_have_windows(self, urls: list[str]) -> bool:
        """Rank 0 asks every engine for its window layout; all ranks get the answer (a collective)."""
        answer: list[bool | None] = [None]
        if self.rank == 0:
            headers = bearer(self.settings.api_key)
            answer = [engines_have_windows(urls, headers, self.settings.timeout_s)]
        dist.broadcast_object_list(answer, src=0)
        return bool(answer[0])


def make_refitter(
    config: Config, rank: int, world_size: int, is_cuda: bool, dtype: torch.dtype | None
) -> Refitter:
    """The refit of training rank ``rank`` of ``world_size``, sending floating weights as ``dtype`` (None: as
    they are), configured by ``config`` (transfer mode, placement, bucket size, engine key, deadlines)."""
    return Refitter(RefitSettings.from_config(config), rank, world_size, is_cuda, dtype)
