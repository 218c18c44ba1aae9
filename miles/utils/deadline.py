"""One deadline helper for user callables (reward functions, tools): sync or async, each call bounded in time.

A sync function runs in a daemon thread, so the event loop keeps serving the other samples while it runs, and a
call that never returns is abandoned at its deadline (it does not keep the loop's executor, and so interpreter
shutdown, waiting). An async function runs as a task, cancelled at its deadline. A function that raises
`TimeoutError` itself is not mistaken for an expired deadline: only the deadline raises `DeadlineExceeded`.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable


class DeadlineExceeded(TimeoutError):
    """A call did not finish within its deadline; the message names the phase, the function and the flag."""


def in_daemon_thread(fn: Callable[..., object], *args: object) -> asyncio.Future[object]:
    """Run the sync call `fn(*args)` in a daemon thread; a future of the running loop gets its result."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[object] = loop.create_future()

    def deliver(result: object, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def body() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(deliver, result, error)
        except RuntimeError:  # the loop closed while an abandoned (expired) call was still running
            pass

    threading.Thread(target=body, name=f"miles-call-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
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
