"""The OpenAI-compatible session server: `POST /sessions/{id}/v1/chat/completions`, `GET /sessions/{id}/v1/models`.

A session is a URL prefix, so any OpenAI client works by `base_url` alone (`{server}/sessions/{id}/v1`). Each
request is generated token-in, token-out by the engines through the rollout's `GenerateClient` and recorded by
the session's `Session` (see `recorder`). It binds 127.0.0.1 and requires `Authorization: Bearer <api key>`
(a random key unless one is given); a request without it answers 401.

Supported request fields: `messages` (text content), `tools` (rendered by the tokenizer's chat template; Qwen3's
`<tool_call>` JSON is parsed back into `tool_calls`), `tool_choice` "auto" or "none", `temperature`, `top_p`,
`max_tokens` / `max_completion_tokens`, `n`, `logprobs` (no `top_logprobs`), `stop`, `seed` (ignored: request
ids seed the engines), `stream` (the finished answer sent as `chat.completion.chunk` events, not token by
token), `stream_options.include_usage`, `model`, `user`, `parallel_tool_calls`. Anything else answers 400
naming the field. With `strict_sampling` (training) a `temperature` or `top_p` other than the run's answers
400 naming --rollout-temperature / --rollout-top-p: the trainer scores the tokens at the run's settings.

The server runs as a task in the event loop of its caller (the rollout runner's), next to the generate client.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import secrets
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from miles.rollout.session.chat import (
    Choice,
    chunk_bodies,
    completion_body,
    normalize_messages,
    parse_tool_calls,
    turn_text,
)
from miles.rollout.session.recorder import Prepared, Session, TurnRecord

if TYPE_CHECKING:
    import uvicorn

    from miles.rollout.base_types import SamplingSettings
    from miles.rollout.generate_client import GenerateClient

KNOWN_FIELDS = frozenset(
    {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
     "n", "logprobs", "top_logprobs", "stop", "seed", "stream", "stream_options", "user", "parallel_tool_calls"}
)  # fmt: skip
MAX_N = 16
# Idle agent connections stay open this long: well past an OpenAI client's pool expiry (httpx's default 5 s), so
# an agent never reuses a connection the server is closing (uvicorn's default, also 5 s, races it: ReadError).
AGENT_KEEP_ALIVE_S = 30


class RequestError(ValueError):
    """A request the server refuses (400, or `status`)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SessionInfo:
    """What the server knows of an open session besides its recorder."""

    recorder: Session
    sample_index: int
    rid_prefix: str  # request ids: <prefix>-s<request>-c<choice>
    sampling: SamplingSettings  # the run's (or the eval set's) sampling settings


class _KeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.api_key:
            headers = dict(scope.get("headers") or [])
            parts = headers.get(b"authorization", b"").decode("latin-1").split(" ", 1)
            ok = (
                len(parts) == 2
                and parts[0].lower() == "bearer"
                and hmac.compare_digest(parts[1], self.api_key)
            )
            if not ok:
                body = {"error": {"message": "missing or wrong API key", "type": "invalid_request_error"}}
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


class SessionServer:
    """Sessions over one generate client; `start()` serves them on 127.0.0.1 (or `host`) at a free port."""

    def __init__(
        self,
        client: GenerateClient,
        tokenizer: Any,
        sampling: SamplingSettings,
        api_key: str | None = "",
        host: str = "127.0.0.1",
        model_name: str = "miles-policy",
        strict_sampling: bool = False,
    ) -> None:
        """`api_key` "" draws a random key; None serves without one (tests only)."""
        self.client, self.tokenizer, self.sampling = client, tokenizer, sampling
        self.api_key = secrets.token_urlsafe(24) if api_key == "" else api_key
        self.host, self.model_name, self.strict_sampling = host, model_name, strict_sampling
        self.sessions: dict[str, SessionInfo] = {}
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------------------------------ sessions
    def open(
        self,
        session_id: str,
        sample_index: int = 0,
        rid_prefix: str | None = None,
        sampling: SamplingSettings | None = None,
    ) -> Session:
        """Open a session; `sampling` (default: the server's) gives its defaults and, strict, its settings."""
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        recorder = Session(session_id, self.tokenizer)
        prefix = rid_prefix or f"session-{session_id}"
        self.sessions[session_id] = SessionInfo(recorder, sample_index, prefix, sampling or self.sampling)
        return recorder

    def close(self, session_id: str) -> Session:
        return self.sessions.pop(session_id).recorder

    def base_url(self, session_id: str) -> str:
        return f"http://{self.host}:{self.port}/sessions/{session_id}/v1"

    # ------------------------------------------------------------------------------------------ serving
    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
            timeout_keep_alive=AGENT_KEEP_ALIVE_S,
        )
        self._server = uvicorn.Server(config)
        # a fresh context: requests the server makes are not part of whatever request batch the caller is in
        self._task = contextvars.Context().run(asyncio.ensure_future, self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it stopped
                raise RuntimeError("session server stopped before it started")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server, self._task = None, None

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="miles session server")
        app.add_middleware(_KeyMiddleware, api_key=self.api_key)

        @app.get("/sessions/{session_id}/v1/models")
        async def models(session_id: str) -> JSONResponse:
            if session_id not in self.sessions:
                return _error(404, f"no open session {session_id!r}")
            card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles"}
            return JSONResponse({"object": "list", "data": [card]})

        @app.post("/sessions/{session_id}/v1/chat/completions", response_model=None)
        async def chat(session_id: str, request: Request) -> JSONResponse | StreamingResponse:
            try:
                body = json.loads(await request.body() or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                info = self.sessions.get(session_id)
                if info is None:
                    raise RequestError(f"no open session {session_id!r}", 404)
                answer = await self.complete(info, body)
            except RequestError as e:
                return _error(e.status, str(e))
            except ValueError as e:  # bad messages, undecodable JSON
                return _error(400, str(e))
            if not body.get("stream"):
                return JSONResponse(answer)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(answer, usage), media_type="text/event-stream")

        return app

    # ------------------------------------------------------------------------------------------ requests
    def _sampling_params(self, s: SamplingSettings, body: dict, budget_left: int) -> dict[str, object]:
        for name, flag, default in (
            ("temperature", "--rollout-temperature", s.temperature),
            ("top_p", "--rollout-top-p", s.top_p),
        ):
            value = body.get(name)
            if value is not None and self.strict_sampling and float(value) != float(default):
                raise RequestError(
                    f"{name}={value} differs from the run's {flag}={default}: the trainer scores the sampled "
                    f"tokens at {flag}; leave {name} unset or equal to it"
                )
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise RequestError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        params = s.to_request(min(max_tokens or s.max_new_tokens, budget_left))
        for name in ("temperature", "top_p"):
            if body.get(name) is not None:
                params[name] = float(body[name])
        stop = body.get("stop")
        if stop:
            params["stop"] = [stop] if isinstance(stop, str) else list(stop)
        return params

    def _check(self, body: dict) -> tuple[int, bool]:
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if unknown:
            raise RequestError(f"unsupported request fields {unknown}; supported: {sorted(KNOWN_FIELDS)}")
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an int in [1, {MAX_N}], got {n!r}")
        if body.get("top_logprobs"):
            raise RequestError("top_logprobs is not supported (logprobs=true gives each sampled token's)")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none"):
            raise RequestError(f"tool_choice {choice!r} is not supported; use 'auto' or 'none'")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list of {'type': 'function', 'function': {...}}")
        return n, bool(tools) and choice != "none"

    async def complete(self, info: SessionInfo, body: dict) -> dict:
        """Generate and record the choices of one request; its `chat.completion` body."""
        n, with_tools = self._check(body)
        messages = normalize_messages(body.get("messages"))
        tools = body.get("tools") if with_tools else None
        rec = info.recorder
        prepared = rec.prepare(messages, tools)
        left = info.sampling.max_new_tokens - (len(prepared.input_ids) - prepared.prompt_len)
        request = prepared.request
        cid = f"chatcmpl-{info.recorder.session_id}-{request}"
        if left <= 0:  # the response budget (--rollout-max-response-len) is spent: nothing more is generated
            empty = Choice(parse_tool_calls("", False), "length", [] if body.get("logprobs") else None, [])
            return completion_body(cid, self.model_name, [empty] * n, len(prepared.input_ids), 0)
        params = self._sampling_params(info.sampling, body, left)
        outs = await asyncio.gather(
            *(
                self.client.generate(
                    prepared.input_ids, params, info.sample_index, "session generate",
                    rid=f"{info.rid_prefix}-s{request}-c{i}",
                )
                for i in range(n)
            )
        )  # fmt: skip
        choices = [
            self._record(rec, prepared, messages, out, with_tools, bool(body.get("logprobs"))) for out in outs
        ]
        used = sum(len(o.output_ids) for o in outs)
        return completion_body(cid, self.model_name, choices, len(prepared.input_ids), used)

    def _record(
        self, rec: Session, prepared: Prepared, messages: list, out: Any, with_tools: bool, logprobs: bool
    ) -> Choice:
        if out.finish_reason == "abort":
            raise RequestError("the generation was aborted (the rollout is ending); retry later", 503)
        lps = out.log_probs if out.log_probs is not None else [0.0] * len(out.output_ids)
        text = turn_text(self.tokenizer, out.output_ids)
        turn = parse_tool_calls(text, with_tools)
        node = rec.record(
            prepared,
            messages,
            turn.message(),
            TurnRecord(
                list(prepared.input_ids),
                list(out.output_ids),
                list(lps),
                out.weight_version,
                out.finish_reason,
            ),
        )
        finish = "length" if out.finish_reason == "length" else ("tool_calls" if turn.tool_calls else "stop")
        entries = None
        if logprobs:
            entries = [(self.tokenizer.decode([t]), float(lp)) for t, lp in zip(out.output_ids, lps)]
        ids = [f"call_{rec.session_id}_{node.id}_{k}" for k in range(len(turn.tool_calls))]
        return Choice(turn, finish, entries, ids)


async def _sse(answer: dict, include_usage: bool) -> Any:
    for chunk in chunk_bodies(answer):
        if chunk["choices"] or include_usage:
            yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
