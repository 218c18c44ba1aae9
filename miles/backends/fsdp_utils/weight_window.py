"""Refit embedded engines through a shared-memory weight window (CPU colocated): one write, one HTTP call.

The per-bucket tensor-handle path copies every tensor into fresh shared memory, pickles handles, posts each
bucket and lets the engine copy it again. Here the trainer owns one file in shared memory per engine, created at
the first refit from the engine's own layout (`/weight_window_layout`, see `miles.engines.local.window`) and reused
at every refit: each leader rank writes every tensor straight into its view (the engine's fused q/k/v and
gate/up blocks included; FSDP2 shards are all-gathered once per bucket and unpacked directly into the views, no
full tensor in between), then posts one `/update_weights_from_window`, and the engine points its parameters at
the views without copying. That one call is the whole refit on the engine: its own weight-update session (no
begin/end round trips), and its answer names the weight version the engine then serves, which must be ours;
`check_equal` compares per-tensor checksums as on every other path.

Only the embedded engine speaks this (`miles.backends.fsdp_utils.actor` picks it when every engine answers the
layout endpoint); SGLang engines keep the handle path and its contract. A restarted engine has no mapping: the next
`update_weights_from_window` names the same file, and the engine maps it again. The file lives until the trainer
process exits (it is unlinked then).

The same design on GPUs (CUDA IPC), not built: it could not be tested where it was written (no GPU).
The window would be one device buffer the trainer allocates once per engine from the same layout; its handle
(`torch.multiprocessing.reductions.reduce_tensor` of the flat buffer: the `cudaIpcMemHandle_t` of the allocation
plus offset, or an expandable-segments handle) travels once, with `/update_weights_from_window` naming it instead
of a path, and the engine opens it once (`rebuild_cuda_tensor`) and keeps its views, exactly as it keeps the
mapped file here. Per refit the trainer's gather writes into the buffer on its stream and synchronises before
the HTTP call (the engine then reads it on its own stream, so no CUDA event needs to cross processes); the layout
digest and the weight version keep the same role. What differs from shared memory: the buffer must come from
outside the caching allocator's reuse (or be kept referenced for the engine's lifetime), an engine on another
device needs peer access, and a release (`/release_memory_occupation`) on the engine must drop its views, since
the memory is the trainer's.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref

import torch
from torch import nn

from miles.backends.fsdp_utils.engine_client import compare_checksums, engine_checksums
from miles.backends.fsdp_utils.update_weight_utils import (
    Bucket,
    ColocatedWeightUpdater,
    RefitJob,
    RefitSetup,
    _hf_tensors,
    stream_buckets,
)
from miles.engines.local.window import WINDOW_PREFIX, WindowLayout
from miles.utils.engine_http import EngineStatusError, post_engine, request

LAYOUT_ENDPOINT = "weight_window_layout"


def engines_have_windows(urls: list[str], headers: dict[str, str], timeout_s: float) -> bool:
    """Whether every engine serves the window endpoints (the embedded engine does, SGLang answers 404)."""
    for url in urls:
        try:
            request("POST", url, LAYOUT_ENDPOINT, "window probe", timeout_s, headers, {})
        except EngineStatusError:
            return False
    return True


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class TrainerWindow:
    """The trainer's side of one engine's window: the file, its layout, and a view per accepted name."""

    def __init__(self, layout: WindowLayout, directory: str | None = None):
        self.layout = layout
        self.path = os.path.join(directory or _shm_dir(), f"{WINDOW_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        flat = torch.from_file(self.path, shared=True, size=layout.numel, dtype=layout.dtype)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        canonical = layout.views(flat)
        self.views = {alias: canonical[name] for alias, name in layout.aliases.items()}
        self.canonical_names = set(canonical)

    def check_covers(self, named: list[tuple[str, tuple[int, ...]]]) -> None:
        """Every engine parameter must be written by exactly these (name, shape) pairs; ValueError otherwise."""
        unknown = [n for n, _ in named if n not in self.views]
        if unknown:
            raise ValueError(f"the engine has no parameters {unknown[:4]} (of {len(unknown)} unknown names)")
        bad = [(n, s, tuple(self.views[n].shape)) for n, s in named if tuple(s) != tuple(self.views[n].shape)]
        if bad:
            raise ValueError(f"shapes differ between trainer and engine (name, trainer, engine): {bad[:4]}")
        written = {self.layout.aliases[n] for n, _ in named}
        missing = sorted(self.canonical_names - written)
        if missing:
            raise ValueError(
                f"the trainer's model lacks engine parameters {missing[:4]} (refit would miss them)"
            )

    def close(self) -> None:
        self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class WindowWeightUpdater(ColocatedWeightUpdater):
    """Colocated refit of embedded engines through a weight window per engine (see the module docstring).

    Same engine/rank assignment as `ColocatedWeightUpdater` (engine ``e`` is served by rank ``e``; the embedded
    engine has no tensor parallelism, so ``ranks_per_engine`` must be 1). Collective over the training ranks.
    """

    def __init__(self, setup: RefitSetup) -> None:
        if setup.ranks_per_engine != 1:
            raise ValueError(
                f"weight windows serve embedded engines, which have one rank each, not {setup.ranks_per_engine} "
                "(--rollout-num-gpus-per-engine)"
            )
        super().__init__(setup)
        self.window: TrainerWindow | None = None
        # engines whose window every rank knows to be set up (the same set on every rank, so that all skip the
        # setup's collective together)
        self._ready: set[str] = set()

    def _ensure_window(self, url: str, model: nn.Module, dtype: torch.dtype | None) -> None:
        if self.window is not None:
            return
        answer = post_engine(url, LAYOUT_ENDPOINT, {}, self._headers, self.timeout_s, "window layout")
        window = TrainerWindow(WindowLayout.from_json(answer["layout"]))
        try:
            window.check_covers([(e.name, tuple(e.tensor.shape)) for e in _hf_tensors(model, dtype)])
        except ValueError as exc:
            window.close()
            raise ValueError(f"engine {url}: weight window: {exc}") from None
        self.window = window

    def _refit(self, job: RefitJob, targets: list[str]) -> int:
        """Write every tensor into the targeted engines' windows and load them with one call per engine, inside
        a weight-update session; verify versions (and checksums with ``check_equal``). Returns the buckets."""
        url = self._url_if_targeted(targets)
        if not self._ready.issuperset(targets):
            self._on(True, lambda: url and self._ensure_window(url, job.model, job.dtype))
            self._ready.update(targets)
        # the sharded tensors are gathered straight into our window's views (`_write` then has nothing to copy)
        into = self.window.views if url is not None and self.window is not None else None
        checksums: dict[str, str] | None = {} if self.check_equal and url is not None else None
        error: str | None = None

        def write(bucket: Bucket, index: int, is_last: bool) -> None:
            # every rank consumes every bucket (the gathers are collective); a failed write is reported after
            nonlocal error
            if url is None or error is not None:
                return
            try:
                self._write(bucket)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                error = f"rank {self.rank}: {type(exc).__name__}: {exc}"

        n_buckets = stream_buckets(job, checksums, write, into)
        self._raise_if_any_failed(error)
        self._on(True, lambda: url and self._load(url, job.weight_version, checksums))
        return n_buckets

    @torch.no_grad()
    def _write(self, bucket: Bucket) -> None:
        assert self.window is not None
        for name, tensor in bucket:
            view = self.window.views[name]
            if tensor is not view:  # not gathered into the window already
                view.copy_(tensor)

    def _load(self, url: str, weight_version: str, checksums: dict[str, str] | None) -> None:
        """One call loads the window (its own weight-update session on the engine); the answer names the version
        the engine now serves, which must be ours; with ``check_equal`` the checksums are compared too."""
        assert self.window is not None
        body = {
            "path": self.window.path,
            "layout_digest": self.window.layout.digest(),
            "flush_cache": True,
            "weight_version": weight_version,
        }
        answer = post_engine(
            url, "update_weights_from_window", body, self._headers, self.timeout_s, f"refit {weight_version}"
        )
        if answer.get("weight_version") != weight_version:
            raise RuntimeError(
                f"engine {url} serves weight version {answer.get('weight_version')!r} after refit {weight_version}"
            )
        if checksums is not None:
            compare_checksums(
                url,
                checksums,
                engine_checksums(url, self._headers, self.timeout_s, weight_version),
                weight_version,
            )
