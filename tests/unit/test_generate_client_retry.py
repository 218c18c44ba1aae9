"""GenerateClient: transient failures (connection refused, 502/503/504) are retried with backoff within the
request's deadline; other errors are not; an expired deadline names the phase, URL, sample and the engines that do
not answer /health."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from miles.rollout.generate_batching import batching
from miles.rollout.generate_client import EngineError, GenerateClient

OK = {"text": "7", "output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"}}}


def run(handler, timeout: float = 5.0, engines: tuple[str, ...] = ("http://e0:1",)):
    async def go():
        async with GenerateClient(
            "http://router:1", list(engines), None, timeout, 4, transport=httpx.MockTransport(handler)
        ) as client:
            return await client.generate([1, 2], {"max_new_tokens": 1}, 3, "rollout generate (rollout0)")

    return asyncio.run(go())


def test_transient_errors_are_retried_until_an_engine_answers():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":  # no router worker list; the engine answers /health
            return httpx.Response(404 if request.url.path == "/workers" else 200)
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
        if request.url.path == "/workers":
            return httpx.Response(404)
        calls.append(1)
        return httpx.Response(status, text="bad sampling params")

    with pytest.raises(
        EngineError,
        match=f"rollout generate \\(rollout0\\): http://e0:1/generate answered "
        f"{status}: bad sampling params \\(sample 3\\)",
    ):
        run(handler)
    assert len(calls) == 1


def test_retries_stop_at_the_deadline_and_name_the_dead_engine():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "e1":  # the dead engine
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(503, text="No available workers")

    with pytest.raises(EngineError) as info:
        run(handler, timeout=1.0, engines=("http://e0:1", "http://e1:1"))
    msg = str(info.value)
    assert "rollout generate (rollout0): http://e0:1/generate answered 503" in msg  # generation goes to e0
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
        async with GenerateClient(
            "http://r:1", engines, None, 5.0, 4, transport=httpx.MockTransport(handler)
        ) as c:
            await c.abort_all("rollout abort")

    asyncio.run(go(["http://e0:1", "http://e1:1"]))
    assert sorted(seen) == ["e0", "e1"]  # one attempt each: aborts are not retried
    with pytest.raises(EngineError, match="http://e2:1/abort_request answered 401"):
        asyncio.run(go(["http://e0:1", "http://e2:1"]))


class Fleet:
    """Two engines behind a router whose worker list the test edits (what the health monitor does)."""

    def __init__(self) -> None:
        self.listed = ["http://e0:1", "http://e1:1"]
        self.dead: set[str] = set()
        self.generated: list[str] = []  # engine host per answered /generate

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}:1"
        if request.url.host == "router":
            return httpx.Response(200, json={"workers": [{"id": u, "url": u} for u in self.listed]})
        if url in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        self.generated.append(request.url.host)
        n = len(json.loads(request.content)["input_ids"])
        return httpx.Response(200, json=OK if n == 2 else [OK] * n)


def test_a_dead_engine_is_set_aside_and_comes_back_only_when_the_router_lists_it_again(monkeypatch):
    import miles.rollout.generate_client as ec

    monkeypatch.setattr(ec, "ENGINE_LIST_TTL_S", 0.0)  # read the router's list before every request
    fleet = Fleet()

    async def go():
        async with GenerateClient(
            "http://router:1", ["http://e0:1", "http://e1:1"], None, 5.0, 4,
            transport=httpx.MockTransport(fleet.handler),
        ) as c:  # fmt: skip

            async def gen(i: int) -> None:
                out = await c.generate([1, 2], {"max_new_tokens": 1}, i, "rollout generate (rollout0)")
                assert out.output_ids == [7]

            await gen(0)
            await gen(1)
            assert fleet.generated == ["e0", "e1"]  # round robin while both are fine
            fleet.dead.add("http://e0:1")  # SIGKILL: still listed, refuses connections
            await gen(2)
            await gen(3)
            assert fleet.generated[2:] == ["e1", "e1"]  # retried on e1 at once, e0 set aside
            fleet.listed = ["http://e1:1"]  # the monitor takes e0 out and restarts it (initial weights)
            fleet.dead.clear()
            await gen(4)
            await gen(5)
            assert fleet.generated[4:] == ["e1", "e1"]  # e0 answers /health but is not readmitted yet
            fleet.listed = ["http://e0:1", "http://e1:1"]  # refit and readmitted
            await gen(6)
            await gen(7)
            assert sorted(fleet.generated[6:]) == ["e0", "e1"]

    asyncio.run(go())


def test_a_batch_in_flight_on_an_engine_that_dies_is_answered_by_another():
    fleet = Fleet()
    fleet.dead.add("http://e0:1")

    async def go():
        async with GenerateClient(
            "http://router:1", ["http://e0:1", "http://e1:1"], None, 5.0, 8,
            transport=httpx.MockTransport(fleet.handler),
        ) as c:  # fmt: skip
            with batching("group"):
                outs = await asyncio.gather(
                    *(
                        c.generate([1, i], {"max_new_tokens": 1}, i, "rollout generate", rid=f"r{i}")
                        for i in range(4)
                    )
                )
            return outs, c.requests_sent

    outs, sent = asyncio.run(go())
    assert [o.output_ids for o in outs] == [[7]] * 4
    assert fleet.generated == ["e1"] and sent == 2  # one batch, sent twice: e0 refused it, e1 answered


RETRACTED = (
    '{"error": {"message": "Retracted under decode memory pressure without a KV backup. Retry later."}}'
)


@pytest.mark.parametrize("engines", [("http://e0:1",), ("http://e0:1", "http://e1:1")])
def test_an_engine_answering_503_forever_ends_the_request_at_its_deadline(engines):
    """SGLang answers 503 while its /health answers 200 after a 1 s wait: the health probe readmits the engine on
    every pass, which once retried a 3 s request for minutes. The deadline ends it, naming the engine and its last
    answer, with a bounded number of attempts (backoff, not a tight loop)."""
    posts: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            await asyncio.sleep(1.0)  # SGLang's /health: a one-token generation, checked after 1 s
            return httpx.Response(200)
        if request.url.path == "/workers":
            return httpx.Response(404)
        posts.append(request.url.host)
        return httpx.Response(503, text=RETRACTED)

    async def go():
        async with GenerateClient(
            "http://router:1", list(engines), None, 3.0, 4, transport=httpx.MockTransport(handler)
        ) as client:
            return await asyncio.wait_for(
                client.generate([1, 2], {"max_new_tokens": 1}, 3, "rollout generate (rollout0)"), 60
            )

    with pytest.raises(EngineError) as info:
        asyncio.run(go())
    msg = str(info.value)
    assert "/generate answered 503: " in msg and "Retracted under decode memory pressure" in msg
    assert "http://e0:1/generate" in msg or "http://e1:1/generate" in msg
    assert "(sample 3)" in msg and "gave up after" in msg and "in 3s, the request deadline" in msg
    # at most one attempt per engine per wait; waits of 0.2, 0.4, 0.8, 1.6 s fill a 3 s deadline
    assert len(engines) <= len(posts) <= 5 * len(engines), posts


def test_no_answer_names_the_request_deadline_not_what_was_left_of_it():
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(404)
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(
        EngineError, match=r"no answer from http://e0:1/generate within the request deadline \(2s\)"
    ):
        run(handler, timeout=2.0)


def test_a_request_an_engine_refused_goes_to_another_at_once(monkeypatch):
    """One engine answers 503 forever while its /health answers 200 (so every probe readmits it), the other is
    busy: a request the first refused goes to the busy one, not back to the one that refused it (which has fewer
    requests in flight) until a backoff has passed."""
    import miles.rollout.generate_client as ec

    monkeypatch.setattr(ec, "ENGINE_LIST_TTL_S", 0.0)  # probe the set-aside engine before every pick
    posts: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/health", "/workers"):
            return httpx.Response(200 if request.url.path == "/health" else 404)
        posts.append(request.url.host)
        if request.url.host == "e0":
            return httpx.Response(503, text=RETRACTED)
        await asyncio.sleep(0.5)  # e1 is slow: its requests stay in flight
        return httpx.Response(200, json=OK)

    async def go():
        async with GenerateClient(
            "http://router:1", ["http://e0:1", "http://e1:1"], None, 30.0, 4,
            transport=httpx.MockTransport(handler),
        ) as c:  # fmt: skip
            outs = await asyncio.gather(
                *(
                    c.generate([1, 2], {"max_new_tokens": 1}, i, "rollout generate (rollout0)")
                    for i in range(4)
                )
            )
            assert [o.output_ids for o in outs] == [[7]] * 4

    asyncio.run(go())
    assert posts.count("e1") == 4 and posts.count("e0") <= 4, posts  # e0: at most once per request
