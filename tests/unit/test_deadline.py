"""`miles.utils.deadline`: sync calls in reused daemon threads, each bounded by its own deadline."""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles.utils.deadline import DeadlineExceeded, call_with_deadline


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
