"""The persistent generation worker of `--fully-async` (runs inside the rollout manager actor, on a thread).

It keeps prompt groups in flight across train steps: up to `--async-max-concurrent-samples` samples generate at
once, new prompts start as soon as there is room and the pacing rule allows it (`miles.rollout.async_buffer`),
and finished, scored groups go into a bounded buffer (`--async-data-buffer-capacity-factor` x
`--rollout-batch-size` groups); a finished group waits (holding its place in flight) while the buffer is full.
The trainer takes a batch (`take_batch`) as soon as enough groups are buffered; a group beyond
`--max-weight-staleness` is handled by `--async-unused-samples-handler` (retry: its prompt starts again, fresh;
drop: it is spent).

Refit under running requests (`pause` / `resume`, called by the driver around its refit): the engines get
`/pause_generation` with `--pause-generation-mode`; no new group starts while paused. Requests an abort pause
returned (finish reason "abort") continue once generation resumes, from where they stopped (partial rollout),
so every segment records the weight version that produced it; in-place and retract pauses keep the requests
inside the engine. Group `c` (the c-th admitted) names its requests `rollout<c // batch>-<slot>`, as the
synchronous driver names rollout `c // batch`'s: with `--max-weight-staleness 0` and interval 1 both drivers
send the same requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from miles.rollout.async_buffer import (
    ADMIT_VERSION,
    GroupBuffer,
    WorkerFailed,
    admission_room,
    oldest_version,
    stale,
)
from miles.rollout.default_rollout import generate_group, group_verdict
from miles.rollout.generate_batching import batching
from miles.utils.types import Sample, SampleStatus

if TYPE_CHECKING:
    from miles.rollout.base_types import RolloutContext
    from miles.rollout.runner import RolloutRunner

logger = logging.getLogger(__name__)

GROUP_KEY = "async_group"  # Sample.metadata key: the group's admission number
STALENESS_KEY = "weight_staleness"  # Sample.metadata key, set when trained: trained version - oldest version
MAX_CONTINUATIONS = 1000  # abort pauses one group may live through before the worker gives up on it


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    """The --fully-async flags the worker reads."""

    batch: int  # --rollout-batch-size (groups)
    group_size: int  # --n-samples-per-prompt
    max_concurrent_samples: int  # --async-max-concurrent-samples (resolved)
    capacity: int  # floor(--async-data-buffer-capacity-factor x --rollout-batch-size)
    max_staleness: int | None  # --max-weight-staleness
    retry: bool  # --async-unused-samples-handler retry (else drop)
    fault_tolerant: bool = False  # --use-fault-tolerance: a dead engine is skipped by pause / continue


class AsyncGenerationWorker:
    """See the module docstring. `start` launches the thread; the other public methods are called from the
    rollout manager's thread."""

    def __init__(self, runner: RolloutRunner, settings: AsyncSettings, start_version: int) -> None:
        self.runner, self.s = runner, settings
        self.buffer = GroupBuffer(settings.capacity)
        self.engine_version = start_version  # the engines' weights
        self.next_step = start_version  # the train step whose batch is taken next
        self.taken_for_step = 0  # groups already taken for that batch
        self.in_flight = 0  # groups admitted, not yet in the buffer
        self.waiting_put = 0  # of those, groups done generating that wait for room in the buffer
        self.pacing_limited = False  # the last admission admitted fewer groups than the free slots held
        self.clock = PhaseClock()  # where the worker's time went since the last take_batch
        self.admitted = 0  # groups admitted so far: names their requests
        self.retry: deque[list[Sample]] = deque()  # fresh groups to start again (retry handler)
        self.fresh: dict[int, list[Sample]] = {}  # admission number -> the group as admitted (for retry)
        self.admit_at: dict[int, int] = {}  # admission number -> engine version then, until taken or filtered
        self.counts: Counter[str] = Counter()  # this step's dropped, retried, continued, ... (see take_batch)
        self.paused = False
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- the rollout manager's side
    def start(self, timeout: float = 60.0) -> None:
        self._thread = threading.Thread(target=self._main, name="miles-async-generation", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise WorkerFailed(f"the generation worker did not start within {timeout:.0f}s")

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pause(self, mode: str, timeout: float) -> None:
        """No new group starts; every engine gets /pause_generation {"mode": mode}."""
        self._call(self._pause(mode), timeout)

    def resume(self, version: int, timeout: float) -> None:
        """The engines hold weight version `version` now: /continue_generation on every engine; generation
        goes on (aborted requests continue)."""
        self._call(self._resume(version), timeout)

    def take_batch(self, step: int, timeout: float | None) -> tuple[list[list[Sample]], dict[str, float]]:
        """`--rollout-batch-size` groups for train step `step` (policy version `step`), in admission order,
        each sample's staleness in its metadata, and this step's `async/*` metrics."""
        s = self.s
        with self._lock:
            self.next_step, self.taken_for_step = step, 0
        kept: list[list[Sample]] = []
        until = None if timeout is None else time.monotonic() + timeout
        while len(kept) < s.batch:
            group = self._take_group(step, s.batch - len(kept), until)
            with self._lock:
                self.admit_at.pop(group[0].metadata[GROUP_KEY], None)
                fresh = self.fresh.pop(group[0].metadata[GROUP_KEY])
                if not stale(group, step, s.max_staleness):
                    kept.append(group)
                    self.taken_for_step += 1
                else:  # generated, never trained: what the bound costs the engines
                    self.counts["discarded_tokens"] += sum(smp.response_length for smp in group)
                    self.counts["retried_groups" if s.retry else "dropped_groups"] += 1
                    if s.retry:
                        self.retry.append(fresh)
            self._wake()
        with self._lock:
            self.next_step, self.taken_for_step = step + 1, 0
            counts, self.counts = self.counts, Counter()
            clock = self.clock.take(self._state())
            extra = {"buffered_groups": len(self.buffer), "in_flight_groups": self.in_flight}
            extra["engine_version"] = self.engine_version
        self._wake()
        kept.sort(key=lambda g: g[0].metadata[GROUP_KEY])
        metrics = _step_metrics(kept, step, {**counts, **extra})  # (a Counter union would drop the zeros)
        return kept, metrics | {f"timing/async_worker/{k}": v for k, v in clock.items()}

    def _take_group(self, step: int, need: int, until: float | None) -> list[Sample]:
        """The next group for step `step`'s batch (`need` still to take). Without a bound: the first finished.
        With one, a group is never left behind to go stale while the trainer could still take it: first the
        buffered groups that would be beyond the bound at the next step (oldest admitted first), then, while
        the groups in flight that must be trained at this step at the latest number at least `need`, wait for
        them (the engines meanwhile generate what pacing admits; a long response no longer ages past the
        bound while later, shorter ones fill the batches); otherwise the first finished. A full buffer is
        taken from anyway (a group that must go now may be waiting for its room)."""
        if self.s.max_staleness is None:
            return self.buffer.take(None if until is None else max(0.0, until - time.monotonic()), self.alive)
        while True:
            with self._lock:
                seen = self.buffer.changes
                key = self._choose(step, need)
            if key is not None:
                return self.buffer.take_where(_has_key(key))
            left = 1.0 if until is None else until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no finished prompt group for step {step} in time")
            t0, for_due = time.monotonic(), len(self.buffer) > 0  # else: nothing finished yet
            self.buffer.wait_change(seen, min(1.0, left), self.alive)
            if for_due:  # what not discarding costs the trainer
                with self._lock:
                    self.clock.waited_for_due += time.monotonic() - t0

    def _choose(self, step: int, need: int) -> int | None:
        """`_take_group`'s choice (under the lock): a buffered group's admission number, or None to wait."""
        bound = self.s.max_staleness
        assert bound is not None
        buffered = self.buffer.snapshot()
        keys = [g[0].metadata[GROUP_KEY] for g in buffered]
        due = [k for k, g in zip(keys, buffered, strict=True) if stale(g, step + 1, bound)]
        if due:  # the last step that may train them (or already beyond: the caller discards them)
            return min(due)
        done = set(keys)
        due_in_flight = sum(1 for c, v in self.admit_at.items() if c not in done and step + 1 - v > bound)
        if keys and (need > due_in_flight or len(keys) >= self.buffer.capacity):
            return keys[0]
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the worker (JSON-able), as of now: the data cursor, the admission count,
        the buffered groups as they finished (trained after a resume exactly as they would have been, their
        weight versions kept) with their prompts as admitted (for a retry), and the prompts of the groups in
        flight and those waiting to be retried: both start again, fresh, after a resume (the engines' partial
        work is not kept), counted in `async/resumed_groups`. Taken under the admission lock, so every admitted,
        untrained group is in exactly one of the lists."""
        with self._lock:
            buffered = self.buffer.snapshot()
            keys = [g[0].metadata[GROUP_KEY] for g in buffered]
            in_flight = [self.fresh[c] for c in sorted(self.fresh) if c not in set(keys)]
            return {
                "data_source": self.runner.data_source.state_dict(),
                "admitted": self.admitted,
                "buffered": [_dicts(g) for g in buffered],
                "buffered_fresh": [_dicts(self.fresh[c]) for c in keys],
                "restart": [_dicts(g) for g in [*self.retry, *in_flight]],
                "counts": dict(self.counts),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a `state_dict()` (before `start`; the data cursor is the rollout runner's to restore)."""
        self.admitted = int(state["admitted"])
        for group, fresh in zip(state["buffered"], state["buffered_fresh"], strict=True):
            samples = _samples(group)
            self.fresh[samples[0].metadata[GROUP_KEY]] = _samples(fresh)
            if not self.buffer.put(samples, timeout=0):
                raise ValueError(f"the checkpoint buffers more groups than the capacity {self.s.capacity}")
        self.retry.extend(_samples(g) for g in state["restart"])
        self.counts.update(state["counts"])
        self.counts["resumed_groups"] += len(state["restart"])

    def stop(self, timeout: float = 30.0) -> None:
        self._stop = True
        self.buffer.close()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def _call(self, coro: Coroutine[Any, Any, None], timeout: float) -> None:
        assert self._loop is not None, "the generation worker is not running"
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(self._wake_event.set)

    # ---------------------------------------------------------------- the worker's thread
    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's take_batch
            self.buffer.fail(e)
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake_event = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        tasks: set[asyncio.Task] = set()
        async with self.runner.make_client() as client:
            self.client = client
            ctx = self.runner.context(client)
            self._ready.set()
            try:
                while not self._stop:
                    self._launch(ctx, self._admit(), tasks)
                    await self._wake_event.wait()
                    self._wake_event.clear()
                    for task in [t for t in tasks if t.done()]:
                        tasks.discard(task)
                        task.result()  # a failed group stops the worker
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _state(self) -> dict[str, float]:
        """What the clock integrates over time (under the lock): samples generating, whether some finished group
        waits for buffer room, whether pacing holds back prompts that slots would admit, whether paused."""
        generating = (self.in_flight - self.waiting_put) * self.s.group_size
        return {
            "generating_samples": float(generating),
            "buffer_full_s": float(self.waiting_put > 0),
            "pacing_stall_s": float(self.pacing_limited and not self.paused),
            "paused_s": float(self.paused),
            "idle_s": float(generating == 0 and not self.paused),
        }

    def _admit(self) -> list[list[Sample]]:
        """The groups that may start now (retries first, then fresh prompts), prepared and counted in flight."""
        s = self.s
        with self._lock:
            if self.paused or self._stop:
                return []
            slots = (s.max_concurrent_samples - self.in_flight * s.group_size) // s.group_size
            room = admission_room(
                engine_version=self.engine_version,
                next_step=self.next_step,
                ahead=self.in_flight + len(self.buffer) + self.taken_for_step,
                batch=s.batch,
                max_staleness=s.max_staleness,
                free_samples=s.max_concurrent_samples - self.in_flight * s.group_size,
                group_size=s.group_size,
            )
            groups = [self.retry.popleft() for _ in range(min(room, len(self.retry)))]
            if room > len(groups):
                groups += self.runner.data_source.next_batch(room - len(groups))
            for group in groups:
                c, self.admitted = self.admitted, self.admitted + 1
                self.fresh[c] = copy.deepcopy(group)
                self.admit_at[c] = self.engine_version
                for j, sample in enumerate(group):
                    sample.index = (c % s.batch) * s.group_size + j
                    sample.metadata[GROUP_KEY] = c
                    sample.metadata[ADMIT_VERSION] = self.engine_version
                    sample.metadata["start_rollout_id"] = c // s.batch
            self.pacing_limited = room < slots
            self.in_flight += len(groups)
            self.clock.tick(self._state())
            return groups

    def _launch(self, ctx: RolloutContext, groups: list[list[Sample]], tasks: set[asyncio.Task]) -> None:
        """Start `groups`. With bound 0 those started together are one version's whole batch, trained together:
        they share batch requests (one per engine), as the synchronous rollout sends a batch. Otherwise each
        group's requests go out as their own batch request: an engine answers a batch request only when all its
        items are done, so a shared one would hold every group's slots until its slowest response ended (the
        long tail the worker exists to fill)."""
        together = bool(groups) and self.s.max_staleness == 0
        with batching(object(), per_engine=True) if together else contextlib.nullcontext():
            for group in groups:
                task = asyncio.ensure_future(self._run_group(ctx, group))
                task.add_done_callback(lambda _: self._wake_event.set())
                tasks.add(task)

    async def _run_group(self, ctx: RolloutContext, group: list[Sample]) -> None:
        """Generate (continuing after abort pauses), score, filter, then wait for room in the buffer."""
        step = group[0].metadata["start_rollout_id"]
        gen_ctx = dataclasses.replace(ctx.generate_ctx, request_id_prefix=f"rollout{step}")
        try:
            for _ in range(MAX_CONTINUATIONS):
                await self._resumed.wait()
                await generate_group(ctx, gen_ctx, group)
                aborted = sum(smp.status == SampleStatus.ABORTED for smp in group)
                if not aborted:
                    break
                with self._lock:
                    self.counts["continued_samples"] += aborted
            else:
                raise WorkerFailed(f"group {step}: still aborted after {MAX_CONTINUATIONS} continuations")
            failed = await ctx.scorer.score(group)
            verdict = group_verdict(ctx, group)
            with self._lock:
                self.counts["reward_failed"] += failed
                if not verdict.keep:
                    self.counts[f"filtered_groups/{verdict.reason or 'filtered'}"] += 1
                    self.fresh.pop(group[0].metadata[GROUP_KEY], None)
                    self.admit_at.pop(group[0].metadata[GROUP_KEY], None)
            if verdict.keep:
                with self._lock:
                    self.waiting_put += 1
                    self.clock.tick(self._state())
                try:  # a thread hop only when the buffer is full (put blocks then)
                    if not self.buffer.put(group, timeout=0):
                        await asyncio.to_thread(self.buffer.put, group)
                finally:
                    with self._lock:
                        self.waiting_put -= 1
        finally:
            with self._lock:
                self.in_flight -= 1
                self.clock.tick(self._state())
            self.buffer.poke()  # a trainer waiting for this group (filtered, or failed) looks again

    async def _pause(self, mode: str) -> None:
        with self._lock:
            self.paused = True
            self.clock.tick(self._state())
        self._resumed.clear()
        await self._post_all("pause_generation", {"mode": mode})

    async def _resume(self, version: int) -> None:
        await self._post_all("continue_generation", {})
        with self._lock:
            self.paused, self.engine_version = False, version
            self.clock.tick(self._state())
        self._resumed.set()
        self._wake_event.set()

    async def _post_all(self, endpoint: str, body: dict) -> None:
        phase = f"fully async refit ({endpoint})"
        urls = list(self.client.engine_urls)
        results = await asyncio.gather(
            *(self.client.post(f"{url}/{endpoint}", body, phase, retry=False) for url in urls),
            return_exceptions=True,
        )
        _skip_dead_engines(urls, results, self.s.fault_tolerant, endpoint)


class PhaseClock:
    """Time integrals of the worker's state between two `take`s (`timing/async_worker/*`): `tick(state)` when the
    state changes (the previous state held since the last tick); `take(state)` returns the integrals
    (`generating_samples`: the time-mean of the samples generating; every other key: seconds) and starts again;
    `wait_for_due_s`: how long the trainer waited for groups due at its step while others were buffered."""

    def __init__(self) -> None:
        self.since = self.start = time.monotonic()
        self.state: dict[str, float] = {}
        self.sums: dict[str, float] = {}
        self.waited_for_due = 0.0  # see the class docstring

    def tick(self, state: dict[str, float]) -> None:
        now = time.monotonic()
        for key, value in self.state.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * (now - self.since)
        self.since, self.state = now, state

    def take(self, state: dict[str, float]) -> dict[str, float]:
        self.tick(state)
        span = max(self.since - self.start, 1e-9)
        out = dict(self.sums)
        out["generating_samples"] = self.sums.get("generating_samples", 0.0) / span
        out["span_s"], out["wait_for_due_s"] = span, self.waited_for_due
        self.start, self.sums, self.waited_for_due = self.since, {}, 0.0
        return out


def _skip_dead_engines(urls: list[str], results: list[Any], fault_tolerant: bool, endpoint: str) -> None:
    """Raise the first engine's error, except with --use-fault-tolerance while some engine answered: a dead
    engine holds no request to pause or continue, and the health monitor restarts it (the driver refits and
    readmits it before generation continues, `miles.ray.async_faults`)."""
    errors = [(url, r) for url, r in zip(urls, results) if isinstance(r, BaseException)]
    if not errors:
        return
    if not fault_tolerant or len(errors) == len(urls) or not all(isinstance(e, Exception) for _, e in errors):
        raise errors[0][1]
    for url, e in errors:
        logger.warning("/%s: engine %s did not answer (%s); left to the health monitor", endpoint, url, e)


def _has_key(key: int) -> Callable[[list[Sample]], bool]:
    """Whether a group is the one admitted as number `key`."""
    return lambda group: group[0].metadata[GROUP_KEY] == key


def _dicts(group: list[Sample]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in group]


def _samples(group: list[dict[str, Any]]) -> list[Sample]:
    return [Sample.from_dict(d) for d in group]


def _step_metrics(kept: list[list[Sample]], step: int, counts: dict[str, int]) -> dict[str, float]:
    """`async/*` metrics of one train step: each trained sample's staleness (mean, max, and a histogram:
    `async/staleness/<k>` samples k versions old) and this step's counts (dropped, retried, continued ...)."""
    ages = []
    for group in kept:
        for sample in group:
            oldest = oldest_version(sample)
            sample.metadata[STALENESS_KEY] = age = 0 if oldest is None else step - oldest
            ages.append(age)
    metrics = {f"async/{k}": float(v) for k, v in counts.items()}
    for key in ("dropped_groups", "retried_groups", "discarded_tokens", "continued_samples", "resumed_groups",
                "reward_failed"):  # fmt: skip
        metrics.setdefault(f"async/{key}", 0.0)
    metrics["async/staleness_mean"] = sum(ages) / len(ages)
    metrics["async/staleness_max"] = float(max(ages))
    for age, n in sorted(Counter(ages).items()):
        metrics[f"async/staleness/{age}"] = float(n)
    return metrics
