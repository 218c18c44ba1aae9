"""EngineClient: transient failures (connection refused, 502/503/504) are retried with backoff within the
request's deadline; other errors are not; an expired deadline names the phase, URL, sample and the engines that do
not answer /health."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from miles.rollout.engine_client import EngineClient, EngineError

OK = {"text": "7", "output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"}}}


def run(handler, timeout: float = 5.0, engines: tuple[str, ...] = ("http://e0:1",)):
    async def go():
        async with EngineClient(
            "http://router:1", list(engines), None, timeout, 4, transport=httpx.MockTransport(handler)
        ) as client:
            return await client.generate([1, 2], {"max_new_tokens": 1}, 3, "rollout generate (rollout0)")

    return asyncio.run(go())


def test_transient_errors_are_retried_until_an_engine_answers():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.ConnectError("connection refused", request=request)
        if len(calls) in (2, 3):
            return httpx.Response(503 if len(calls) == 2 else 502, text="No available workers")
        return httpx.Response(200, json=OK)

    out = run(handler)
    assert out.output_ids == [7] and calls == ["/generate"] * 4


@pytest.mark.parametrize("status", [400, 500])
def test_other_errors_are_not_retried(status):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(status, text="bad sampling params")

    with pytest.raises(
        EngineError,
        match=f"rollout generate \\(rollout0\\): http://router:1/generate answered "
        f"{status}: bad sampling params \\(sample 3\\)",
    ):
        run(handler)
    assert len(calls) == 1


def test_retries_stop_at_the_deadline_and_name_the_dead_engine():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "e1":  # the dead engine behind the router
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(503, text="No available workers")

    with pytest.raises(EngineError) as info:
        run(handler, timeout=1.0, engines=("http://e0:1", "http://e1:1"))
    msg = str(info.value)
    assert "rollout generate (rollout0): http://router:1/generate answered 503" in msg
    assert "(sample 3)" in msg and "gave up after" in msg
    assert "engines not answering /health: ['http://e1:1']" in msg


def test_abort_skips_an_unreachable_engine_but_not_an_error():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "e1":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200 if request.url.host == "e0" else 401, text="")

    async def go(engines):
        async with EngineClient(
            "http://r:1", engines, None, 5.0, 4, transport=httpx.MockTransport(handler)
        ) as c:
            await c.abort_all("rollout abort")

    asyncio.run(go(["http://e0:1", "http://e1:1"]))
    assert sorted(seen) == ["e0", "e1"]  # one attempt each: aborts are not retried
    with pytest.raises(EngineError, match="http://e2:1/abort_request answered 401"):
        asyncio.run(go(["http://e0:1", "http://e2:1"]))
