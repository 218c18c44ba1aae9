"""The embedded server's wait for a /generate batch: one event-loop hop for the whole batch, results in order,
the first error in the batch's order."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from miles.engines.local.server import _when_all_done


def _finish_from_a_thread(futs: list[Future[int]], values: list[int | BaseException]) -> threading.Thread:
    def run() -> None:
        for f, v in reversed(list(zip(futs, values))):  # the last item finishes first
            f.set_exception(v) if isinstance(v, BaseException) else f.set_result(v)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_results_in_order_with_one_loop_hop_for_the_batch() -> None:
    async def go() -> list[int]:
        loop = asyncio.get_running_loop()
        hops = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal hops
            hops += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        futs: list[Future[int]] = [Future() for _ in range(64)]
        waiting = _when_all_done(futs)
        t = _finish_from_a_thread(futs, list(range(64)))
        out = await asyncio.wait_for(waiting, 5)
        t.join()
        assert hops == 1
        return out

    assert asyncio.run(go()) == list(range(64))


def test_the_first_error_in_batch_order_fails_it_and_an_empty_batch_is_done() -> None:
    async def go() -> None:
        futs: list[Future[int]] = [Future() for _ in range(3)]
        waiting = _when_all_done(futs)
        t = _finish_from_a_thread(futs, [0, ValueError("item 1"), KeyError("item 2")])
        with pytest.raises(ValueError, match="item 1"):
            await asyncio.wait_for(waiting, 5)
        t.join()
        assert await _when_all_done([]) == []

    asyncio.run(go())


@pytest.mark.parametrize("error", [StopIteration(), StopAsyncIteration("x"), KeyboardInterrupt()])
def test_an_error_an_asyncio_future_refuses_is_delivered_wrapped_not_hung(error: BaseException) -> None:
    """A model step that raises StopIteration (transformers' get_rope_index on a stray image pad) must answer
    the request with an error: asyncio futures refuse StopIteration, which left the request waiting out its
    deadline."""

    async def go() -> None:
        futs: list[Future[int]] = [Future() for _ in range(2)]
        waiting = _when_all_done(futs)
        t = _finish_from_a_thread(futs, [1, error])
        with pytest.raises(RuntimeError, match=type(error).__name__) as info:
            await asyncio.wait_for(waiting, 5)
        assert info.value.__cause__ is error
        t.join()

    asyncio.run(go())
