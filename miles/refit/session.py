"""The weight-update session every refit transport runs in, and what they share: `RefitSetup` (engines, ranks
per engine, this rank, key, deadline, checksum check) and the `WeightUpdater` base class.

A transport (`miles.refit.tensor_handles`, `miles.refit.window`, `miles.refit.broadcast`) implements `push` over
`miles.refit.buckets.stream_buckets` or `row_copies`. All follow SGLang 0.5.23's contract
(docs/sglang-contract.md): every refit runs inside a weight-update session, ``/begin_weight_update`` on every
engine before the first bucket and ``/end_weight_update`` after the last, also when a bucket failed; no bucket
(and so no collective) starts before every engine opened its session. After the session each engine must report
the new ``weight_version`` (``/model_info``), and with ``check_equal`` its per-tensor checksums
(``/weights_checker``) must equal the trainer's, hashed while sending, per TP rank's shard
(`miles.refit.checksums`, `miles.refit.engine_endpoints`). Every step that one rank does
for all (an HTTP call) goes through `run_agreed`: all ranks learn every rank's error and raise together, so none
is left waiting in a collective.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.refit.buckets import RefitJob, RefitSource
from miles.refit.checksums import RefitChecksums, ShardSpec
from miles.utils.engine_control_http import bearer


@dataclass(frozen=True)
class RefitSetup:
    """What every refit transport is built from: the engines (in order), the training ranks per engine (the
    engine TP size), this process's ``rank`` and ``world_size`` in ``group`` (None: the default group), the
    engines' API key, the deadline of each engine call, whether to compare per-tensor checksums after each
    refit (``check_equal``), and the scale format of block-FP8 linear weights (None: sent as they are)."""

    engine_urls: list[str]
    ranks_per_engine: int
    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    check_equal: bool = False
    fp8_scale_format: str | None = None  # --rollout-weight-quantization fp8: block FP8 with these scales
    checksum_kind: str = "sha256"  # the engines' hash (`miles.utils.weight_checksum.device_hash_kind`)

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
        self.fp8_scale_format = setup.fp8_scale_format
        self.checksum_kind = setup.checksum_kind
        self.checks: RefitChecksums | None = None  # the last refit's checksums (on the ranks that compare)
        self.headers = bearer(setup.api_key)
        group = setup.group
        self.global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)
        ]
        # Control plane on gloo: strings and flags travel on CPU whatever the training backend is.
        # new_group is collective over the default group: every rank creates every group, in the same order.
        self.ctrl_group = dist.new_group(self.global_ranks, backend="gloo")

    def update(
        self,
        model: RefitSource,
        bucket_bytes: int,
        weight_version: str,
        dtype: torch.dtype | None = None,
        engines: list[str] | None = None,
        flush_cache: bool = True,
    ) -> int:
        """Push all weights of ``model`` (cast to ``dtype``, in buckets of at most ``bucket_bytes``) to
        ``engines`` (None: all) as ``weight_version``, then verify them; returns the number of buckets.
        ``flush_cache``: False when the engines hold requests paused in place (`RefitJob`)."""
        job = RefitJob(model, bucket_bytes, weight_version, dtype, self.fp8_scale_format, flush_cache)
        return self.push(job, self.targets(engines))

    @abstractmethod
    def push(self, job: RefitJob, targets: list[str]) -> int:
        """Push ``job`` to ``targets`` (some of the engines, in their order); returns the number of buckets."""

    def new_checksums(self, job: RefitJob, here: bool) -> RefitChecksums | None:
        """With ``check_equal``, where ``here`` (the rank that compares): the accumulator of this refit's
        trainer-side checksums, hashing only the names the engines reported last time (all at first)."""
        if not (self.check_equal and here):
            return None
        config = getattr(job.model, "config", None)
        spec = ShardSpec(
            self.ranks_per_engine, self.checksum_kind, getattr(config, "num_key_value_heads", None)
        )
        wanted = self.checks.reported if self.checks is not None and self.checks.reported else None
        self.checks = RefitChecksums(spec, wanted)
        return self.checks

    def resume_engines(
        self, targets: list[str], resume: Callable[[list[str]], None], tags: Sequence[str] = ()
    ) -> None:
        """Before the next `update` moves any weight: ``resume(urls)`` gives ``targets`` back the memory they
        released (``tags``, what it resumes). Here rank 0 resumes every target at once and every rank raises its
        error, so none refits alone; a transport may resume each engine from the rank that serves it instead, or
        send ``tags`` with its load (`miles.refit.window`)."""
        self.run_agreed(self.rank == 0, lambda: resume(targets))

    def engines_restarted(self, urls: list[str]) -> None:
        """Engines that were restarted (new processes); by default nothing to redo (checked to be ours)."""
        self.targets(urls)

    def targets(self, engines: list[str] | None) -> list[str]:
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
        self.raise_together(error)

    def raise_together(self, error: str | None) -> None:
        """Collective: all ranks raise when any rank's ``error`` is set (see `raise_if_any_failed`)."""
        raise_if_any_failed(error, self.world_size, self.ctrl_group)


def raise_if_any_failed(
    error: str | None, world_size: int, group: dist.ProcessGroup | None, what: str = "weight update failed"
) -> None:
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
        raise RuntimeError(f"{what}: " + " | ".join(failed))
