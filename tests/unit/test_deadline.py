"""`miles.utils.deadline`: sync calls in reused daemon threads, each bounded by its own deadline."""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles.utils.deadline import DeadlineExceeded, call_each_with_deadline, call_with_deadline


def test_sync_calls_reuse_idle_threads_and_a_stuck_one_is_never_handed_another() -> None:
    release = threading.Event()
    where: list[threading.Thread] = []  # the thread objects stay alive here: distinct threads, distinct ids
    alive: set[int] = set()  # the threads there were before the sequential calls

    def stuck() -> None:
        release.wait()

    def quick(i: int) -> int:
        where.append(threading.current_thread())
        if i == 3:
            raise KeyError(i)
        return i * 2

    async def go() -> None:
        with pytest.raises(DeadlineExceeded, match="stuck call"):
            await call_with_deadline(stuck, timeout=0.05, what="stuck call")
        alive.update(id(t) for t in threading.enumerate())
        for round_ in range(3):  # sequential calls: each finds an idle thread (at most the first starts one)
            assert await call_with_deadline(quick, round_, timeout=5, what="quick") == round_ * 2
        with pytest.raises(KeyError):  # the function's own error, not a deadline
            await call_with_deadline(quick, 3, timeout=5, what="quick")
        many = await asyncio.gather(*(call_with_deadline(quick, i, timeout=5, what="q") for i in (4, 5, 6)))
        assert many == [8, 10, 12]

    before = threading.active_count()
    asyncio.run(go())
    # the four sequential calls started one thread at most
    assert len({id(t) for t in where[:4]} - alive) <= 1
    # the stuck call keeps its thread; the others reused at most 3 (the concurrent ones)
    assert threading.active_count() - before <= 4
    release.set()


def test_a_batch_of_quick_calls_runs_in_one_thread_in_order_with_errors_as_outcomes() -> None:
    threads: list[threading.Thread] = []

    def quick(i: int) -> int:
        threads.append(threading.current_thread())
        if i == 2:
            raise KeyError(i)
        return i * 10

    out = asyncio.run(call_each_with_deadline(quick, [(i,) for i in range(6)], timeout=5, what=str))
    assert out[:2] == [0, 10] and isinstance(out[2], KeyError) and out[3:] == [30, 40, 50]
    assert len({id(t) for t in threads}) == 1 and threads[0] is not threading.main_thread()


def test_a_hung_call_in_a_batch_expires_alone_and_the_calls_after_it_still_run() -> None:
    release = threading.Event()

    def maybe_hang(i: int) -> int:
        if i == 1:
            release.wait()
        return i

    # the hung call is released only after the batch has returned: a batch that waited for it would never return,
    # so a timer frees it after a minute to let such a failure show as an outcome instead of a hung test
    rescue = threading.Timer(60, release.set)
    rescue.start()
    out = asyncio.run(
        call_each_with_deadline(maybe_hang, [(i,) for i in range(4)], timeout=0.3, what=lambda i: f"call {i}")
    )
    freed_by_timer = release.is_set()
    release.set()
    rescue.cancel()
    assert not freed_by_timer
    assert out[0] == 0 and out[2:] == [2, 3]
    assert isinstance(out[1], DeadlineExceeded) and str(out[1]) == "call 1"


def test_slow_calls_of_a_batch_spill_to_threads_of_their_own() -> None:
    """A call still running after spill_s sends the calls not yet started to their own threads: four calls that
    each wait for all four to be running at once all finish; run in turn, the first would wait for the others
    until its barrier broke."""
    together = threading.Barrier(4)

    def slow(i: int) -> int:
        together.wait(timeout=30)
        return i

    out = asyncio.run(call_each_with_deadline(slow, [(i,) for i in range(4)], timeout=60, what=str))
    assert out == [0, 1, 2, 3]


def test_awaitables_returned_by_sync_calls_run_side_by_side() -> None:
    """Two sync calls hand back coroutines that each wait for the other: awaited one after the other, the first
    would wait for the second until its deadline; side by side both finish."""
    started: list[asyncio.Event] = []

    def returns_awaitable(i: int):  # a sync function handing back a coroutine
        async def meet() -> int:
            started[i].set()
            await asyncio.wait_for(started[1 - i].wait(), 30)
            return i

        return meet()

    async def go() -> list[object]:
        started.extend([asyncio.Event(), asyncio.Event()])
        return await call_each_with_deadline(returns_awaitable, [(0,), (1,)], timeout=60, what=str)

    assert asyncio.run(go()) == [0, 1]


def test_a_batch_awaits_what_sync_calls_return_and_runs_async_functions_as_tasks() -> None:
    async def later(i: int) -> int:
        await asyncio.sleep(0.01)
        return i + 100

    def returns_awaitable(i: int):  # a sync function handing back a coroutine
        return later(i)

    async def never(i: int) -> int:
        await asyncio.Event().wait()
        return i

    async def go() -> None:
        assert await call_each_with_deadline(returns_awaitable, [(1,), (2,)], timeout=5, what=str) == [
            101,
            102,
        ]
        assert await call_each_with_deadline(later, [(3,)], timeout=5, what=str) == [103]
        (late,) = await call_each_with_deadline(never, [(4,)], timeout=0.05, what=lambda i: f"never {i}")
        assert isinstance(late, DeadlineExceeded) and str(late) == "never 0"

    asyncio.run(go())
