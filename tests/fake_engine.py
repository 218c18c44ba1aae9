"""An in-process fake SGLang engine on `httpx.MockTransport`, for rollout tests without servers.

It answers `POST /generate` and `POST /abort_request` the way SGLang does (field names of `io_struct.py`) and is
strict about what it is sent: `input_ids` must be a list of ints, `rid` unique among live requests,
`sampling_params.max_new_tokens` >= 1, and no answer is longer than `max_new_tokens`. What a request answers is
decided by the test's `respond(input_ids, sampling_params, rid) -> Reply`. A reply with `hold=True` waits until
an `/abort_request` (then it answers its first `partial` tokens with finish reason "abort"), like a long
generation cut short.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx

GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "rid"}
SAMPLING_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "skip_special_tokens",
    "stop",
    "stop_token_ids",
    "sampling_seed",
}


@dataclass
class Reply:
    tokens: list[int]
    finish: str = "stop"  # "stop" | "length"; capped at max_new_tokens -> "length"
    hold: bool = False  # wait for /abort_request, then answer tokens[:partial] with "abort"
    partial: int = 1
    text: str | None = None  # default: the token ids joined with spaces


def log_prob_of(token: int, position: int) -> float:
    """The fake's deterministic log-prob of `token` at response position `position`."""
    return -0.01 * (token % 7 + 1) - 0.001 * position


class FakeEngine:
    """Serves one engine at `url` (also its own router): `transport` goes to `GenerateClient`/`RolloutRunner`."""

    def __init__(
        self, respond: Callable[[list[int], dict, str], Reply], url: str = "http://fake-engine:1"
    ) -> None:
        self.respond = respond
        self.url = url
        self.weight_version = "0"
        self.requests: list[dict] = []  # one per generation (a batch's items each)
        self.posts = 0  # POST /generate requests (a batch counts once)
        self.batch_sizes: list[int] = []  # items per accepted /generate request
        self.aborts = 0
        self._live: set[str] = set()
        self._abort = asyncio.Event()
        self.transport = httpx.MockTransport(self._handle)

    def _check(self, body: dict) -> str | None:
        unknown = set(body) - GENERATE_FIELDS
        if unknown:
            return f"unknown fields {sorted(unknown)}"
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            return f"input_ids must be a non-empty list of token ids, got {ids!r}"
        sp = body.get("sampling_params") or {}
        if set(sp) - SAMPLING_FIELDS:
            return f"unknown sampling params {sorted(set(sp) - SAMPLING_FIELDS)}"
        if not isinstance(sp.get("max_new_tokens"), int) or sp["max_new_tokens"] < 1:
            return f"max_new_tokens must be an int >= 1, got {sp.get('max_new_tokens')!r}"
        if body.get("rid") in self._live:
            return f"duplicate rid {body['rid']!r}"
        return None

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        path = request.url.path
        if path == "/abort_request":
            self.aborts += 1
            self._abort.set()
            await asyncio.sleep(0)
            self._abort = asyncio.Event()
            return httpx.Response(200, json={"success": True})
        if path != "/generate":
            return httpx.Response(404, json={"detail": f"no route {path}"})
        self.posts += 1
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            items, problem = _split_batch(body)
            if problem is None and len({it.get("rid") for it in items}) != len(items):
                problem = "rids within one batch must be unique"
            problem = problem or next((p for p in map(self._check, items) if p), None)
            if problem:
                return httpx.Response(400, json={"error": {"message": problem}})
            self.batch_sizes.append(len(items))
            answers = await asyncio.gather(*(self._one(it) for it in items))
            return httpx.Response(200, json=answers)
        problem = self._check(body)
        if problem:
            return httpx.Response(400, json={"error": {"message": problem}})
        self.batch_sizes.append(1)
        return httpx.Response(200, json=await self._one(body))

    async def _one(self, body: dict) -> dict:
        rid = body.get("rid") or f"auto-{len(self.requests)}"
        self.requests.append(body)
        self._live.add(rid)
        try:
            return await self._generate(body, rid)
        finally:
            self._live.discard(rid)

    async def _generate(self, body: dict, rid: str) -> dict:
        sp = body["sampling_params"]
        version = self.weight_version
        reply = self.respond(list(body["input_ids"]), sp, rid)
        tokens, finish = list(reply.tokens), reply.finish
        if reply.hold:
            await self._abort.wait()
            tokens, finish = tokens[: reply.partial], "abort"
        if len(tokens) >= sp["max_new_tokens"] and finish != "abort":
            tokens, finish = (
                tokens[: sp["max_new_tokens"]],
                ("length" if len(tokens) > sp["max_new_tokens"] else finish),
            )
        meta = {
            "finish_reason": {"type": finish},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(tokens),
            "weight_version": version,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[log_prob_of(t, i), t, None] for i, t in enumerate(tokens)]
        text = reply.text if reply.text is not None else " ".join(map(str, tokens))
        return {"text": text, "output_ids": tokens, "meta_info": meta}


def _split_batch(body: dict) -> tuple[list[dict], str | None]:
    """SGLang's batch form (`input_ids` a list of prompts; `sampling_params`, `rid`, `return_logprob` each one
    value or a list of the batch's length) as one body per item, or a problem."""
    n = len(body["input_ids"])
    items: list[dict] = [{"input_ids": ids} for ids in body["input_ids"]]
    for name in ("sampling_params", "rid", "return_logprob"):
        if name not in body:
            continue
        value = body[name]
        if isinstance(value, list):
            if len(value) != n:
                return [], f"{name}: {len(value)} values for a batch of {n}"
            for it, v in zip(items, value):
                it[name] = v
        elif name == "rid":
            for i, it in enumerate(items):
                it[name] = f"{value}-{i}"
        else:
            for it in items:
                it[name] = value
    return items, None
