"""One deadline helper for user callables (reward functions, tools): sync or async, each call bounded in time.

A sync function runs in a daemon thread, so the event loop keeps serving the other samples while it runs, and a
call that never returns is abandoned at its deadline (it does not keep the loop's executor, and so interpreter
shutdown, waiting). The daemon threads are reused: a call goes to one that waits idle, and a new one starts only
when none does (a thread stuck in an abandoned call is never handed another); starting a thread per call cost
the quickstart rollout ~20 ms per 128 rewards. An async function runs as a task, cancelled at its deadline. A
function that raises `TimeoutError` itself is not mistaken for an expired deadline: only the deadline raises
`DeadlineExceeded`.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from collections.abc import Callable


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
