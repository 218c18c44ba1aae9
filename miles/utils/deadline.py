"""One deadline helper for user callables (reward functions, tools): sync or async, each call bounded in time.

A sync function runs in a daemon thread, so the event loop keeps serving the other samples while it runs, and a
call that never returns is abandoned at its deadline (it does not keep the loop's executor, and so interpreter
shutdown, waiting). The daemon threads are reused: a call goes to one that waits idle, and a new one starts only
when none does (a thread stuck in an abandoned call is never handed another); starting a thread per call cost
the quickstart rollout ~20 ms per 128 rewards. An async function runs as a task, cancelled at its deadline. A
function that raises `TimeoutError` itself is not mistaken for an expired deadline: only the deadline raises
`DeadlineExceeded`.

`call_each_with_deadline` runs a batch of calls of one sync function (the rewards of a prompt group) in one
thread, in turn, each still bounded from its own start: one thread hand-off per batch instead of one per call
(the quickstart's 16 groups x 8 math rewards: ~3 ms instead of ~7 ms, and no burst of 128 thread wake-ups
fighting the event loop for the GIL).
A call still running after `SPILL_S` sends every call not yet started to threads of their own, so slow calls
(a remote judge, a sandbox) still run side by side, late by at most `SPILL_S`.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import cast


class DeadlineExceeded(TimeoutError):
    """A call did not finish within its deadline; the message names the phase, the function and the flag."""


class _DaemonThreads:
    """Daemon threads that run jobs and then wait for the next one; `run` hands a job to an idle one or starts
    one. Idle threads stay (they cost a stack and nothing else)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job that no `run` has counted on yet
        self._lock = threading.Lock()

    def run(self, job: Job) -> None:
        """Run `job` in a thread: it does the work and returns the hand-off of its outcome, which runs once the
        thread counts itself idle (so a caller woken by the hand-off finds the thread free)."""
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1
        if reuse:  # every queued job has an idle thread counted for it
            self._jobs.put(job)
        else:
            threading.Thread(target=self._work, args=(job,), name="miles-call", daemon=True).start()

    def _work(self, job: Job) -> None:
        while True:
            hand_off = job()  # never raises: the jobs of `in_daemon_thread` catch everything
            with self._lock:
                self._idle += 1
            hand_off()
            job = self._jobs.get()


Job = Callable[[], Callable[[], None]]
_THREADS = _DaemonThreads()


def in_daemon_thread(fn: Callable[..., object], *args: object) -> asyncio.Future[object]:
    """Run the sync call `fn(*args)` in a daemon thread; a future of the running loop gets its result."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[object] = loop.create_future()

    def deliver(result: object, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def body() -> Callable[[], None]:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e

        def hand_off() -> None:
            try:
                loop.call_soon_threadsafe(deliver, result, error)
            except RuntimeError:  # the loop closed while an abandoned (expired) call was still running
                pass

        return hand_off

    _THREADS.run(body)
    return fut


async def _call(fn: Callable[..., object], *args: object) -> object:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await in_daemon_thread(fn, *args)
    return await out if inspect.isawaitable(out) else out


async def call_with_deadline(fn: Callable[..., object], *args: object, timeout: float, what: str) -> object:
    """`fn(*args)` (sync, async, or sync returning an awaitable), finished within `timeout` seconds.

    Returns its result or raises its exception; past the deadline raises `DeadlineExceeded` with the message
    `what` (the caller names the phase, the function, the sample and the flag that sets the deadline)."""
    task = asyncio.ensure_future(_call(fn, *args))
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except BaseException:  # the caller was cancelled: so is the call
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise DeadlineExceeded(what)
    return task.result()


SPILL_S = 0.02  # how long a batch's call may run before the batch's remaining calls get threads of their own


class _Raised:
    """A call's exception, as a batch's thread hands it over."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_PENDING = object()


class _InTurn:
    """The calls of one batch, claimed in order by the daemon threads that run them; shared with the event loop
    (everything under `lock`). A thread whose call was abandoned at its deadline stops claiming."""

    def __init__(
        self, fn: Callable[..., object], calls: Sequence[tuple[object, ...]], wake: Callable[[], None]
    ):
        self.fn, self.calls, self.wake = fn, list(calls), wake
        self.lock = threading.Lock()
        self.next = 0  # the first call no thread has claimed
        self.started: dict[int, float] = {}  # running calls: index -> time.monotonic() at its start
        self.outcomes: list[object] = [_PENDING] * len(self.calls)
        self.seconds: list[float] = [0.0] * len(self.calls)  # how long each finished call ran
        self.abandoned: set[int] = set()  # calls past their deadline
        self.closed = False  # the awaiting side went away: claim nothing more

    def add_threads(self, count: int) -> None:
        for _ in range(count):
            _THREADS.run(self._job)

    def _job(self) -> Callable[[], None]:
        while True:
            with self.lock:
                if self.closed or self.next >= len(self.calls):
                    break
                i, self.next = self.next, self.next + 1
                start = self.started[i] = time.monotonic()
            try:
                out: object = self.fn(*self.calls[i])
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                out = _Raised(e)
            with self.lock:
                del self.started[i]
                stuck = i in self.abandoned
                if not stuck:
                    self.outcomes[i], self.seconds[i] = out, time.monotonic() - start
            if stuck:  # the batch went on without this thread
                break
        return self.wake


async def call_each_with_deadline(
    fn: Callable[..., object],
    calls: Sequence[tuple[object, ...]],
    timeout: float,
    what: Callable[[int], str],
    spill_s: float = SPILL_S,
) -> list[object]:
    """`fn(*args)` for each `args` of `calls`, each finished within `timeout` seconds of its own start; returns
    their outcomes in order: the result, or the exception the call raised, `DeadlineExceeded(what(i))` for call i
    past its deadline (as `asyncio.gather(..., return_exceptions=True)` over `call_with_deadline`s would).

    An async `fn` runs each call as `call_with_deadline` does, all at once. A sync one: see the module docstring
    (in turn in one daemon thread; after `spill_s`, the rest side by side); a sync call that returns an awaitable
    has what is left of its deadline for it (the awaitables of a batch run side by side)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.gather(
            *(call_with_deadline(fn, *args, timeout=timeout, what=what(i)) for i, args in enumerate(calls)),
            return_exceptions=True,
        )
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(woken.set)
        except RuntimeError:  # the loop closed while an abandoned call was still running
            pass

    batch = _InTurn(fn, calls, wake)
    spilled = False
    try:
        batch.add_threads(min(1, len(batch.calls)))
        while True:
            woken.clear()  # before reading the state: a thread that changes it later sets it again
            with batch.lock:
                now = time.monotonic()
                running = {i: t for i, t in batch.started.items() if i not in batch.abandoned}
                late = [i for i, t in running.items() if now - t >= timeout]
                for i in late:
                    batch.abandoned.add(i)
                    batch.outcomes[i] = _Raised(DeadlineExceeded(what(i)))
                    del running[i]
                unclaimed = len(batch.calls) - batch.next
                if all(o is not _PENDING for o in batch.outcomes):
                    break
            if late and unclaimed:  # the late calls keep their threads: others take the calls after them
                batch.add_threads(len(late))
            if not spilled and unclaimed and any(now - t >= spill_s for t in running.values()):
                spilled = True
                batch.add_threads(unclaimed)
            due = [t + timeout for t in running.values()]
            if unclaimed:  # look again soon: to spill, and to time the calls that start meanwhile
                due.append(now + spill_s)
            try:
                await asyncio.wait_for(woken.wait(), max(0.0, min(due) - now) if due else None)
            except asyncio.TimeoutError:
                pass
    except BaseException:
        with batch.lock:
            batch.closed = True
        raise
    outcomes: list[object] = [out.error if isinstance(out, _Raised) else out for out in batch.outcomes]
    waiting = [i for i, out in enumerate(outcomes) if inspect.isawaitable(out)]
    # the awaitables the sync calls returned run side by side, each within what is left of its own deadline
    if waiting:
        finished = await asyncio.gather(
            *(
                _finish(cast(Awaitable[object], outcomes[i]), timeout - batch.seconds[i], what(i))
                for i in waiting
            )
        )
        for i, out in zip(waiting, finished, strict=True):
            outcomes[i] = out
    return outcomes


async def _finish(awaitable: Awaitable[object], left: float, what: str) -> object:
    """What a sync call's awaitable gives within the `left` seconds of its deadline (its exception as a value)."""
    try:
        return await call_with_deadline(_await, awaitable, timeout=max(left, 0.0), what=what)
    except Exception as e:  # noqa: BLE001 - an outcome, as for the batch's other calls
        return e


async def _await(awaitable: Awaitable[object]) -> object:
    return await awaitable
