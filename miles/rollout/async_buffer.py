"""The pure parts of fully asynchronous generation (`--fully-async`): the bounded buffer of finished prompt
groups, the staleness of a group, and the pacing rule that decides how many new prompts may start now.

Versions are the integer weight versions the driver refits with (`str(rollout_id + 1)` after training rollout
`rollout_id`; the engines start at the first rollout's id). Train step `k` trains policy version `k`.

Staleness of a sample trained at step `k`: `k - v`, where `v` is the oldest weight version that produced any of
its tokens: the smallest of the versions the engine reported per segment (`Sample.weight_versions`) and the
engines' version when the sample was admitted (`ADMIT_VERSION` in its metadata). The admission version matters
with in-place pauses: a request frozen across a refit reports only the version it finished with, although its
first tokens came from the one before. A group's staleness is its oldest sample's.

Pacing (beyond the reference, which only filters stale groups when the trainer takes them): a group admitted
now, with `ahead` groups admitted before it and not yet trained, is expected to be trained at step
`next_step + ahead // batch` (groups are trained roughly in admission order), while its first tokens come from
the engines' current version `engine_version`. It is admitted only when that expected staleness is at most
`--max-weight-staleness N`:

    next_step + ahead // batch - engine_version <= N   <=>   ahead < (engine_version + N + 1 - next_step) * batch

A group whose generation runs long (a long-tailed response) would end up staler than expected if the trainer
took the groups in the order they finish: it takes the groups due at its step first and waits for those still
generating (`AsyncGenerationWorker._take_group`); what still goes beyond the bound (a full buffer) is caught by
the trainer's check (`stale`) and `--async-unused-samples-handler` retries or drops it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from miles.utils.types import Sample

ADMIT_VERSION = "async_admit_version"  # Sample.metadata key: the engines' weight version when it was admitted


def version_number(version: str | int) -> int | None:
    """A weight version as an int (None when it is not one: an external engine's own label)."""
    try:
        return int(version)
    except (TypeError, ValueError):
        return None


def oldest_version(sample: Sample) -> int | None:
    """The oldest weight version that produced (or may have produced) a token of `sample`."""
    versions = [version_number(v) for v in sample.weight_versions]
    if ADMIT_VERSION in sample.metadata:
        versions.append(version_number(sample.metadata[ADMIT_VERSION]))
    known = [v for v in versions if v is not None]
    return min(known) if known else None


def group_staleness(group: list[Sample], trained_version: int) -> int:
    """`trained_version` minus the oldest version of any token of the group (0 when none is known)."""
    oldest = [v for v in (oldest_version(s) for s in group) if v is not None]
    return trained_version - min(oldest) if oldest else 0


def stale(group: list[Sample], trained_version: int, max_staleness: int | None) -> bool:
    """Whether the group is beyond --max-weight-staleness (never without a bound)."""
    return max_staleness is not None and group_staleness(group, trained_version) > max_staleness


def admission_room(
    *,
    engine_version: int,
    next_step: int,
    ahead: int,
    batch: int,
    max_staleness: int | None,
    free_samples: int,
    group_size: int,
) -> int:
    """How many prompt groups may start now: as many as `free_samples` (--async-max-concurrent-samples minus the
    samples in flight) holds, and with a staleness bound only while the pacing rule (module docstring) holds.
    `ahead`: groups admitted and not yet taken for training (in flight, buffered, and those already taken for
    the batch of `next_step`)."""
    room = free_samples // group_size
    if max_staleness is not None:
        room = min(room, (engine_version + max_staleness + 1 - next_step) * batch - ahead)
    return max(0, room)


class WorkerFailed(RuntimeError):
    """The generation worker stopped on an error; the trainer's `take` raises it."""


class GroupBuffer:
    """Finished prompt groups, oldest first, at most `capacity` of them: `put` blocks while it is full, `take`
    while it is empty. Thread-safe (the generation worker's thread puts, the rollout manager's takes). `fail`
    wakes every waiter with the worker's error; `close` wakes producers (their `put` returns False)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._groups: deque[list[Sample]] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.changes = 0  # counts puts, takes and pokes: what `wait_change` waits on

    def _changed(self) -> None:
        self.changes += 1
        self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def put(self, group: list[Sample], timeout: float | None = None) -> bool:
        """Append `group`, waiting for room; False when closed (the group is not kept) or on timeout."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or len(self._groups) < self.capacity, timeout)
            if not ok or self._closed:
                return False
            self._groups.append(group)
            self._changed()
            return True

    def take(self, timeout: float | None = None, alive: Callable[[], bool] = lambda: True) -> list[Sample]:
        """The oldest group, waiting for one (checking `alive` every second); WorkerFailed after `fail`,
        TimeoutError after `timeout` seconds."""
        waited = 0.0
        with self._cond:
            while not self._groups:
                if self._error is not None:
                    raise WorkerFailed(f"the generation worker failed: {self._error!r}") from self._error
                if not alive():
                    raise WorkerFailed("the generation worker stopped")
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"no finished prompt group within {timeout:.0f}s")
                self._cond.wait(1.0)
                waited += 1.0
            group = self._groups.popleft()
            self._changed()
            return group

    def take_where(self, pick: Callable[[list[Sample]], bool]) -> list[Sample]:
        """The oldest buffered group for which `pick` holds (it must be there: KeyError otherwise)."""
        with self._cond:
            for i, group in enumerate(self._groups):
                if pick(group):
                    del self._groups[i]
                    self._changed()
                    return group
        raise KeyError("no buffered group matches")

    def poke(self) -> None:
        """Wake `wait_change` without a put (the producer's state changed otherwise: a group was filtered)."""
        with self._cond:
            self._changed()

    def wait_change(self, seen: int, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Wait up to `timeout` s for `changes` to move past `seen`; WorkerFailed after `fail` or once `alive`
        is false."""
        with self._cond:
            self._cond.wait_for(lambda: self.changes != seen or self._error is not None, timeout)
            if self._error is not None:
                raise WorkerFailed(f"the generation worker failed: {self._error!r}") from self._error
            if not alive():
                raise WorkerFailed("the generation worker stopped")

    def snapshot(self) -> list[list[Sample]]:
        """The buffered groups, oldest first (for a checkpoint; they stay buffered)."""
        with self._cond:
            return list(self._groups)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
