"""Broadcast refit (engines on other devices or nodes): training rank 0 streams the weight buckets to every engine
rank over a side process group (`miles.utils.side_group`), NCCL on GPU and gloo on CPU.

Per refit, inside one SGLang weight-update session per engine (``/begin_weight_update`` ...
``/end_weight_update``, see `miles.refit.session`), rank 0 announces each bucket's
names/dtypes/shapes (``/update_weights_from_distributed``) and broadcasts its tensors in that order; then every
engine must report the new ``weight_version`` (and with ``check_equal`` the trainer's checksums). With a delta
mode (--update-weight-delta, `miles.refit.delta`) rank 0 leaves out the tensors every engine already holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from miles.refit.buckets import Bucket, RefitJob, stream_buckets
from miles.refit.delta import DeltaTracker, probe_bases
from miles.refit.engine_endpoints import begin_sessions, end_sessions, verify_refit
from miles.refit.session import RefitSetup, WeightUpdater
from miles.utils.engine_control_http import post_engine
from miles.utils.net import free_port
from miles.utils.side_group import init_side_group


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What goes on the wire for ``t``: its bytes for FP8, else itself (contiguous)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _wait_fail_fast(done: Callable[[], bool], answers: list[Future], timeout_s: float, what: str) -> None:
    """Wait until ``done()``, failing at once when an engine's answer in ``answers`` is an error (a refusing
    engine never joins the collective, which would otherwise wait for the whole group timeout)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        for f in answers:
            if f.done() and f.exception() is not None:
                raise RuntimeError(f"{what}: {f.exception()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done within {timeout_s:.0f} s (an engine did not take part)")
        time.sleep(0.005)


class DistributedWeightUpdater(WeightUpdater):
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
        setup: RefitSetup,
        master_address: str,
        master_port: int | None = None,
        group_name: str = "miles_weights_update",
        backend: str | None = None,
        delta: str = "none",
    ) -> None:
        if not setup.engine_urls:
            raise ValueError("DistributedWeightUpdater: engine_urls is empty")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weights-update backend {backend!r}: allowed 'nccl', 'gloo'")
        super().__init__(setup)
        self.master_address, self._next_port = master_address, master_port
        self.group_name, self.backend = group_name, backend
        self._group: dist.ProcessGroup | None = None
        self.members: list[str] = []  # engines in the current group, in rank order
        self._lost: set[str] = set()  # members restarted since they joined (they no longer hold the group)
        self.delta = DeltaTracker(delta)  # what each engine acknowledged (rank 0); --update-weight-delta
        self.last_metrics: dict[str, float] = {}  # the last refit's perf/refit_* (rank 0)
        # one thread per engine request, plus one for joining the group while the requests wait for it
        self._pool = ThreadPoolExecutor(
            max_workers=len(self.engine_urls) + 1, thread_name_prefix="miles-refit"
        )

    @property
    def update_world_size(self) -> int:
        return 1 + len(self.members) * self.ranks_per_engine

    def _post_to(self, urls: list[str], endpoint: str, bodies: list[dict], what: str) -> list[Future]:
        return [
            self._pool.submit(post_engine, url, endpoint, body, self.headers, self.timeout_s, what)
            for url, body in zip(urls, bodies, strict=True)
        ]

    def _on_rank0(self, fn: Callable[[], object]) -> None:
        self.run_agreed(self.rank == 0, fn)

    def engines_restarted(self, urls: list[str]) -> None:
        """``urls`` were restarted: they left the group with their old process (the next refit regroups) and
        hold none of the weights they acknowledged (the next refit sends them everything)."""
        self._lost.update(self.targets(urls))
        self.delta.forget(urls)

    def connect(self, engines: list[str] | None = None) -> None:
        """Create the update group with ``engines`` (None: all). Collective over the training ranks."""
        if self._group is not None:
            raise RuntimeError(f"weights-update group {self.group_name!r} is already connected")
        targets = self.targets(engines)
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
                init_side_group, self.master_address, master_port, 0,
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

    def push(self, job: RefitJob, targets: list[str]) -> int:
        """Regroup when the targets are not the group's members (or a member was restarted), then stream
        ``job`` by broadcast inside one weight-update session per engine, and verify."""
        if not self.members:
            raise RuntimeError("DistributedWeightUpdater.update called before connect()")
        if targets != self.members or self._lost:
            self.disconnect()
            self.connect(targets)
        urls, headers, timeout, version = self.members, self.headers, self.timeout_s, job.weight_version
        delta = self.delta
        self._on_rank0(lambda: delta.begin(self._delta_bases(urls, version), version))
        self._on_rank0(lambda: begin_sessions(urls, headers, timeout, version))
        checksums = self.new_checksums(job, self.rank == 0)

        def send(bucket: Bucket, index: int, is_last: bool) -> None:
            last = (is_last, is_last and job.flush_cache)
            self._on_rank0(lambda: self._broadcast(delta.select(bucket), index, last, version))

        try:
            try:
                n_buckets = stream_buckets(job, checksums, send)
            finally:
                self._on_rank0(lambda: end_sessions(urls, headers, timeout, version))
            self._on_rank0(lambda: verify_refit(urls, version, headers, timeout, checksums))
        except BaseException:
            delta.forget(urls)  # what they hold is unknown: the next refit sends them everything
            raise
        delta.acknowledge(version)
        self.last_metrics = delta.stats.metrics()
        return n_buckets

    def _delta_bases(self, urls: list[str], version: str) -> dict[str, str | None]:
        """Per engine, the version it declares intact for a delta (no call when deltas are off)."""
        if self.delta.mode == "none":
            return dict.fromkeys(urls)
        return probe_bases(urls, self.headers, self.timeout_s, version)

    def _broadcast(self, bucket: Bucket, index: int, last: tuple[bool, bool], version: str) -> None:
        """Announce and broadcast ``bucket``; an empty one (a delta left it all out) is skipped, unless it is
        the last, whose request still sets the version (and flushes the cache). ``last``: (is it the last
        bucket, does its request flush the cache)."""
        is_last, flush = last
        if not bucket and not is_last:
            return
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": flush,
            "weight_version": version,
        }
        pending = self._post_to(
            self.members, "update_weights_from_distributed", [body] * len(self.members), f"bucket {index}"
        )
        works = [  # FP8 travels as its bytes (gloo has no FP8 type; NCCL moves the same bytes)
            dist.broadcast(_wire(t), group=self._group, group_src=0, async_op=True) for _, t in bucket
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
