"""Refit embedded engines through a shared-memory weight window (CPU colocated): one write, one HTTP call.

The per-bucket tensor-handle path copies every tensor into fresh shared memory, pickles handles, posts each
bucket and lets the engine copy it again. Here the trainer owns one file in shared memory per engine, created at
the first refit from the engine's own layout (`/weight_window_layout`, see `miles.refit.window_layout`) by the
rank serving that engine, mapped by every training rank and reused at every refit: each rank writes the rows of
its own FSDP2 shards straight into their views in every targeted window (the engine's fused q/k/v and gate/up
blocks included; no all-gather, no full tensor, each byte written once from the shard), the ranks agree that all
wrote, then each engine's rank posts one `/update_weights_from_window`, and the engine points its parameters at
the views without copying; the ranks agree again that every engine loaded. A colocated step's resume of the
engines' released memory (`resume_engines`) travels with that call once the windows are mapped (before that, it
goes first, each engine's from the rank that serves it), and so do the checksums of `check_equal`: one round trip
per engine and refit. Both agreements go through a flag per
rank in shared memory (`HostFlags`: the ranks share the host anyway, and a gloo collective costs a millisecond or
more on a busy 2-core machine), over gloo where the memory model does not order plain stores (not x86). That
one call is the whole refit on the engine: its own weight-update session (no begin/end round trips), and its
answer names the weight version the engine then serves, which must be ours; `check_equal` compares per-tensor
checksums as on every other path.

Only the embedded engine speaks this (`miles.refit.refitter` picks it when every engine answers the
layout endpoint); SGLang engines keep the handle path and its contract. A restarted engine has no mapping: the next
`update_weights_from_window` names the same file, and the engine maps it again. The file lives until its
trainer process exits (it is unlinked then).

The same design on GPUs (CUDA IPC), not built: it could not be tested where it was written (no GPU).
The window would be one device buffer the trainer allocates once per engine from the same layout; its handle
(`torch.multiprocessing.reductions.reduce_tensor` of the flat buffer: the `cudaIpcMemHandle_t` of the allocation
plus offset, or an expandable-segments handle) travels once, with `/update_weights_from_window` naming it instead
of a path, and the engine opens it once (`rebuild_cuda_tensor`) and keeps its views, exactly as it keeps the
mapped file here. Per refit the trainer's write goes into the buffer on its stream and synchronises before
the HTTP call (the engine then reads it on its own stream, so no CUDA event needs to cross processes); the layout
digest and the weight version keep the same role. What differs from shared memory: the buffer must come from
outside the caching allocator's reuse (or be kept referenced for the engine's lifetime), an engine on another
device needs peer access, and a release (`/release_memory_occupation`) on the engine must drop its views, since
the memory is the trainer's.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from miles.refit.buckets import RefitJob, RefitSource, TensorEntry, hf_tensors, plan_buckets, row_copies
from miles.refit.checksums import RefitChecksums
from miles.refit.engine_endpoints import LAYOUT_ENDPOINT, check_engine, checksums_by_rank
from miles.refit.session import RefitSetup
from miles.refit.tensor_handles import ColocatedWeightUpdater
from miles.refit.window_layout import WINDOW_PREFIX, MappedWindow, WindowLayout
from miles.utils.engine_control_http import post_engine, served_here


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# Plain stores into shared memory are seen by other cores in program order only under x86's total store order:
# there a rank that sees another's flag also sees the window rows that rank wrote before it. On weaker memory
# models (ARM, POWER) the agreement stays on gloo, whose socket calls order the writes.
HOST_FLAGS_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
FLAGS_PREFIX = "miles-refit-flags-"


class HostFlags:
    """The refit agreement of training ranks that share a host, through one int64 flag per rank in a file in
    shared memory (rank 0 creates it, the others map it) instead of a collective over the process group.

    Round ``k`` of `agree` (every rank calls it the same number of times, as a collective): each rank stores
    ``2k`` (fine) or ``2k + 1`` (failed) into its flag, then waits until every flag reached ``2k``. A flag above
    ``2k + 1`` belongs to a rank already in a later round, which it entered only after seeing every rank fine in
    this one; a failed rank leaves ``2k + 1`` in place until all ranks have read it (the caller exchanges the
    messages over gloo, which every rank joins). Waiting sleeps between polls (a 2-core host has no core to spin
    on) and gives up after ``timeout_s`` naming the ranks that never arrived."""

    def __init__(self, rank: int, world_size: int, path: str | None = None, directory: str | None = None):
        self.rank, self.world_size = rank, world_size
        self._round = 0
        self._finalizer: weakref.finalize | None = None
        if path is None:  # the creator (rank 0) owns the file
            path = os.path.join(directory or _shm_dir(), f"{FLAGS_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._finalizer = weakref.finalize(self, _unlink, path)
            os.ftruncate(fd, 8 * world_size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != 8 * world_size:
                raise ValueError(
                    f"refit flags {path!r}: {os.fstat(fd).st_size} bytes, {world_size} ranks need 8 each"
                )
            self._map = mmap.mmap(fd, 8 * world_size)
        finally:
            os.close(fd)
        self.path = path
        self._flags = memoryview(self._map).cast("q")

    def agree(self, failed: bool, timeout_s: float) -> bool:
        """This rank's round: publish ``failed``, wait for every rank; whether any rank failed."""
        self._round += 1
        done = 2 * self._round
        self._flags[self.rank] = done + int(failed)
        deadline = time.monotonic() + timeout_s
        pause = 2e-5
        while True:
            flags = self._flags.tolist()
            if min(flags) >= done:
                return done + 1 in flags
            if time.monotonic() > deadline:
                late = [r for r, f in enumerate(flags) if f < done]
                raise TimeoutError(
                    f"refit agreement {self._round}: training ranks {late} did not arrive within {timeout_s} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)

    def close(self) -> None:
        self._flags.release()
        self._map.close()
        if self._finalizer is not None:
            self._finalizer()


class TrainerWindow:
    """The trainer's side of one engine's window: the file, its layout, and a view per accepted name.

    A new window file in ``directory`` (default: /dev/shm) is this window's own (unlinked when it is closed or
    collected); with ``attach_to``, another rank's window file is mapped as the engine maps it (its owner unlinks
    it)."""

    def __init__(self, layout: WindowLayout, directory: str | None = None, attach_to: str | None = None):
        self.layout = layout
        self._finalizer: weakref.finalize | None = None
        if attach_to is None:
            name = f"{WINDOW_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
            self.path = os.path.join(directory or _shm_dir(), name)
            flat = torch.from_file(self.path, shared=True, size=layout.numel, dtype=layout.dtype)
            self._finalizer = weakref.finalize(self, _unlink, self.path)
            canonical = layout.views(flat)
        else:
            self.path = attach_to
            canonical = MappedWindow(attach_to, layout).views
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
        if self._finalizer is not None:
            self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class WindowWeightUpdater(ColocatedWeightUpdater):
    """Colocated refit of embedded engines through a weight window per engine (see the module docstring).

    Same engine/rank assignment as `ColocatedWeightUpdater` (engine ``e`` is served by rank ``e``, which creates
    its window and posts its load; the embedded engine has no tensor parallelism, so ``ranks_per_engine`` must be
    1). Every rank maps every engine's window and writes its own FSDP2 shard rows into each targeted one
    (`write_rows`: nothing crosses the process group but the agreement that all ranks wrote). Collective over the
    training ranks.
    """

    def __init__(self, setup: RefitSetup) -> None:
        if setup.ranks_per_engine != 1:
            raise ValueError(
                f"weight windows serve embedded engines, which have one rank each, not {setup.ranks_per_engine} "
                "(--rollout-num-gpus-per-engine)"
            )
        super().__init__(setup)
        # the window this rank created for its engine (it owns the file), and every engine's window as this rank
        # maps it (every rank maps all of them)
        self.window: TrainerWindow | None = None
        self.windows: dict[str, TrainerWindow] = {}
        # the per-refit agreements (x86 hosts with more than one rank; None: over gloo), made with the windows
        self.flags: HostFlags | None = None
        # what `resume_engines` asked for, run by the next push
        self._resume: Callable[[list[str]], None] | None = None
        self._resume_tags: list[str] | None = None

    def resume_engines(
        self, targets: list[str], resume: Callable[[list[str]], None], tags: Sequence[str] = ()
    ) -> None:
        """Each engine is resumed by the rank that serves it in the next `push` (one call per rank, side by side,
        no thread and no collective of its own). Once every targeted engine's window is mapped, `tags` (when
        given) travel with the load instead (`/update_weights_from_window`'s `resume_tags`: one round trip less
        per engine; the engine's weights are views of the window, so writing it needs nothing resumed) and an
        error is raised on every rank at the push's last agreement; otherwise `resume` runs first thing in the
        push and an error is raised on every rank at its first agreement, before any engine loads."""
        self._resume = resume
        self._resume_tags = list(tags) or None

    def _ensure_window(self, url: str, model: RefitSource, dtype: torch.dtype | None) -> None:
        if self.window is not None:
            return
        answer = post_engine(url, LAYOUT_ENDPOINT, {}, self.headers, self.timeout_s, "window layout")
        layout = answer.get("layout")
        if not isinstance(layout, dict):
            raise ValueError(f"engine {url}: {LAYOUT_ENDPOINT} answered no 'layout' object")
        window = TrainerWindow(WindowLayout.from_json(layout))
        try:
            window.check_covers([(e.name, tuple(e.tensor.shape)) for e in hf_tensors(model, dtype)])
        except ValueError as exc:
            window.close()
            raise ValueError(f"engine {url}: weight window: {exc}") from None
        self.window = window

    def _map_windows(self, targets: list[str], model: RefitSource, dtype: torch.dtype | None) -> None:
        """Each rank serving a targeted engine creates its window (once); then every rank maps every window
        created so far (collective: all ranks call it together, when some target has no window yet)."""
        url = self.url_if_targeted(targets)

        def ensure() -> None:
            if url:
                self._ensure_window(url, model, dtype)

        self.run_agreed(True, ensure)
        window = self.window
        mine = None
        if window is not None:
            assert self.engine_index is not None  # only a rank serving an engine creates a window
            mine = (self.engine_urls[self.engine_index], window.path, window.layout)
        flags_path = None
        if self.rank == 0 and self.flags is None and self.world_size > 1 and HOST_FLAGS_SUPPORTED:
            self.flags = HostFlags(0, self.world_size)
            flags_path = self.flags.path
        created: list[tuple[tuple[str, str, WindowLayout] | None, str | None]] = [(mine, flags_path)]
        if self.world_size > 1:
            created = [(None, None)] * self.world_size
            dist.all_gather_object(created, (mine, flags_path), group=self.ctrl_group)

        def attach() -> None:
            for engine, path, layout in filter(None, (c for c, _ in created)):
                if engine not in self.windows:
                    own = window if window is not None and path == window.path else None
                    self.windows[engine] = own or TrainerWindow(layout, attach_to=path)
            flags_at = created[0][1]
            if flags_at is not None and self.rank != 0:
                self.flags = HostFlags(self.rank, self.world_size, path=flags_at)

        self.run_agreed(True, attach)

    def push(self, job: RefitJob, targets: list[str]) -> int:
        """Write every tensor into the targeted engines' windows (every rank its own rows) and load them with one
        call per engine, inside a weight-update session; verify versions (and checksums with ``check_equal``).
        Returns the number of buckets of the plan (the window needs none: nothing is gathered)."""
        url = self.url_if_targeted(targets)
        resume, self._resume = self._resume, None
        folded, self._resume_tags = self._resume_tags, None
        if resume is not None and folded is not None and all(u in self.windows for u in targets):
            resume = None  # the tags go with the load
        else:
            folded = None
        error: str | None = None
        try:
            if resume is not None and url:
                resume([url])
        except Exception as exc:  # noqa: BLE001 - reported to every rank at the first agreement below
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        if any(u not in self.windows for u in targets):  # the same on every rank: the windows map together
            self.raise_together(error)  # a failed resume first (the layouts of released engines mean nothing)
            self._map_windows(targets, job.model, job.dtype)
        entries = hf_tensors(job.model, job.dtype)
        n_buckets = len(plan_buckets(entries, job.bucket_bytes))
        try:
            destinations = [self.windows[u].views for u in targets]
            with torch.no_grad():
                for dst, src in row_copies(entries, job.dtype, destinations, self.rank, self.world_size):
                    dst.copy_(src)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = error or f"rank {self.rank}: {type(exc).__name__}: {exc}"
        self._agree(error)  # also the agreement that every rank wrote its rows (and resumed its engine)
        error = None
        try:
            if url:
                self._load(url, job, self._checksums(url, job, entries), folded)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        self._agree(error)
        return n_buckets

    def _agree(self, error: str | None) -> None:
        """Every rank learns whether any failed; all raise together with every rank's message. Through the
        host's flags when there are some (the messages then travel over gloo only after a failure)."""
        if self.flags is None or self.flags.agree(error is not None, self.timeout_s):
            self.raise_together(error)

    def _checksums(self, url: str, job: RefitJob, entries: list[TensorEntry]) -> RefitChecksums | None:
        """With ``check_equal``: the checksum of every tensor as the engine is to read it (in our window)."""
        checks = self.new_checksums(job, True)
        if checks is not None:
            views = self.windows[url].views
            checks.add_bucket((e.name, views[e.name]) for e in entries)
        return checks

    def _load(
        self, url: str, job: RefitJob, checksums: RefitChecksums | None, resume_tags: list[str] | None = None
    ) -> None:
        """One call loads the window (its own weight-update session on the engine), resuming ``resume_tags``
        first; the answer names the version the engine now serves, which must be ours; with ``check_equal`` it
        carries the engine's checksums too, compared with ours."""
        window, weight_version = self.windows[url], job.weight_version
        body: dict[str, object] = {
            "path": window.path,
            "layout_digest": window.layout.digest(),
            "flush_cache": job.flush_cache,
            "weight_version": weight_version,
        }
        if resume_tags is not None:
            body["resume_tags"] = resume_tags
        if checksums is not None:
            body["checksums"] = True
        direct = served_here(url)
        if (
            direct is not None
        ):  # the engine this process serves (a CPU rank's): called directly, not over HTTP
            answer = direct("update_weights_from_window", body, self.timeout_s)
        else:
            what = f"refit {weight_version}"
            answer = post_engine(url, "update_weights_from_window", body, self.headers, self.timeout_s, what)
        if answer.get("weight_version") != weight_version:
            raise RuntimeError(
                f"engine {url} serves weight version {answer.get('weight_version')!r} after refit {weight_version}"
            )
        if checksums is not None:
            answered = checksums_by_rank(url, answer) if "ranks" in answer else None
            check_engine(url, weight_version, self.headers, self.timeout_s, checksums, answered)
            spent = answer.get("checksum_seconds")
            checksums.engine_seconds += spent if isinstance(spent, int | float) else 0.0
