"""--lora-refit adapter on the rollout side: the runner asks the engines which miles adapter they serve
(`GET /v1/models`) and every /generate request names it as `lora_path`; with none listed the rollout fails
instead of silently sampling from the base model."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from miles.refit.lora_adapter import adapter_name
from miles.rollout.generate_client import GenerateClient
from miles.rollout.runner import serving_adapter

URLS = ["http://e0", "http://e1"]


def _client(adapters: dict[str, list[str]], seen: list[dict]) -> GenerateClient:
    def handle(request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}"
        if request.url.path == "/v1/models":
            cards = [{"id": "m", "root": "m"}] + [
                {"id": a, "root": f"/{a}", "parent": "m"} for a in adapters[host]
            ]
            return httpx.Response(200, json={"object": "list", "data": cards})
        body = json.loads(request.content)
        seen.append(body)
        out = {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.5, 1, None]],
                                                "finish_reason": {"type": "stop"}}}  # fmt: skip
        return httpx.Response(200, json=out)

    return GenerateClient(
        "http://router", URLS, None, timeout=5.0, concurrency=2, transport=httpx.MockTransport(handle)
    )


def test_requests_name_the_newest_served_adapter():
    seen: list[dict] = []

    async def run() -> str:
        # e1 still lists the previous version next to the new one (between load and unload): the newest wins
        async with _client({"http://e0": [adapter_name("3")], "http://e1": [adapter_name("2"), adapter_name("3")]},
                           seen) as client:  # fmt: skip
            client.lora_path = await serving_adapter(client)
            await client.generate([5, 6], {"max_new_tokens": 1}, sample_index=0, phase="rollout 0")
            return client.lora_path

    assert asyncio.run(run()) == adapter_name("3")
    assert [b["lora_path"] for b in seen] == [adapter_name("3")]


def test_no_served_adapter_fails_the_rollout():
    async def run() -> None:
        async with _client({"http://e0": [], "http://e1": ["someone-elses"]}, []) as client:
            await serving_adapter(client)

    with pytest.raises(RuntimeError, match="no engine of .* lists a miles LoRA adapter"):
        asyncio.run(run())


def test_without_adapter_mode_requests_carry_no_lora_path():
    seen: list[dict] = []

    async def run() -> None:
        async with _client({"http://e0": [], "http://e1": []}, seen) as client:
            await client.generate([5, 6], {"max_new_tokens": 1}, sample_index=0, phase="rollout 0")

    asyncio.run(run())
    assert "lora_path" not in seen[0]
