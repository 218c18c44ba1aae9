"""Pooled HTTP connections must expire on the client before the server closes them.

With httpx's default pool expiry (5 s) against uvicorn's default keep-alive (5 s: SGLang's
SGLANG_TIMEOUT_KEEP_ALIVE, the embedded engine), a connection idle for ~5 s is reused just as the server closes
it and the request dies with ReadError: the e2e agent run logged "session generate: cannot reach .../generate:
ReadError ... setting engine aside" ~15 times in 20 rollouts of ~5 s each. Both hops are checked: the rollout's
client to the engines, and an OpenAI client (the agent) to the session server.
"""

from __future__ import annotations

import asyncio

import uvicorn

from miles.rollout.generate_client import GenerateClient
from miles.rollout.session import server as session_server

ENGINE_KEEP_ALIVE_S = uvicorn.Config(app=None).timeout_keep_alive  # what the embedded engine and SGLang use
MARGIN_S = 2.0  # a busy event loop reads an answer late: the client's idle clock starts after the server's


def test_the_generate_client_drops_idle_engine_connections_well_before_the_engine_does():
    async def expiry() -> float:
        async with GenerateClient("http://r", ["http://e"], None, timeout=5, concurrency=4) as client:
            assert client._lean is not None  # the POSTs' own pool (miles.rollout.lean_http)
            lean = client._lean.keepalive_expiry
            return max(lean, client.http._transport._pool._keepalive_expiry)  # type: ignore[attr-defined]

    assert ENGINE_KEEP_ALIVE_S == 5
    assert asyncio.run(expiry()) <= ENGINE_KEEP_ALIVE_S - MARGIN_S


def test_the_session_server_keeps_idle_agent_connections_well_past_an_openai_clients_expiry():
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    agent_expiry = DEFAULT_CONNECTION_LIMITS.keepalive_expiry or 0.0
    assert session_server.AGENT_KEEP_ALIVE_S >= agent_expiry + MARGIN_S
