"""HTTP layer of the embedded engine: SGLang's native endpoints on FastAPI, over a `LocalEngine`.

Handlers never touch the model: they queue work on the scheduler thread and await its futures with a timeout.
Errors follow SGLang: admin calls answer {"success": false, "message": ...}; /generate answers
{"error": {"message": ...}} with 400 (bad request), 503 (weights/KV cache released or not reloaded) or 504.
Keys follow SGLang's `decide_request_auth` (sglang/srt/utils/auth.py): `--api-key` guards every endpoint but
/health*, /ready*, /metrics*; `--admin-api-key` guards the admin endpoints only (and then replaces `--api-key`
there). A refused request answers 401 {"error": "Unauthorized"}. The contract: docs/sglang-contract.md.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from concurrent.futures import Future
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from miles.engines.local.control import RefitRefused
from miles.engines.local.dist_update import GroupRequest
from miles.engines.local.engine import LocalEngine
from miles.engines.local.engine_loop import deliverable
from miles.engines.local.output import GenerateAnswer
from miles.engines.local.weights import EngineNotReady
from miles.utils.types import JSON

T = TypeVar("T")

logger = logging.getLogger(__name__)

# (path, engine op name, allowed request fields)
_ADMIN_POSTS: list[tuple[str, str, set[str]]] = [
    ("/abort_request", "abort", {"rid", "abort_all"}),
    ("/pause_generation", "pause", {"mode"}),
    ("/continue_generation", "continue", {"torch_empty_cache"}),
    ("/flush_cache", "flush_cache", set()),
    (
        "/update_weights_from_tensor",
        "update_weights_from_tensor",
        {
            "serialized_named_tensors",
            "load_format",
            "flush_cache",
            "weight_version",
            "abort_all_requests",
            "selector",
            "torch_empty_cache",
        },
    ),
    ("/begin_weight_update", "begin_weight_update", {"selector"}),
    ("/end_weight_update", "end_weight_update", set()),
    (
        "/update_weights_from_disk",
        "update_weights_from_disk",
        {"model_path", "load_format", "weight_version", "abort_all_requests", "flush_cache"},
    ),
    ("/release_memory_occupation", "release_memory_occupation", {"tags"}),
    ("/resume_memory_occupation", "resume_memory_occupation", {"tags"}),
    (
        "/update_weights_from_distributed",
        "update_weights_from_distributed",
        {
            "names",
            "dtypes",
            "shapes",
            "group_name",
            "flush_cache",
            "weight_version",
            "abort_all_requests",
            "load_format",
            "selector",
            "torch_empty_cache",
        },
    ),
    ("/destroy_weights_update_group", "destroy_weights_update_group", {"group_name"}),
    ("/get_weights_by_name", "get_weights_by_name", {"name", "truncate_size"}),
    ("/weights_checker", "weights_checker", {"action", "allow_quant_error", "skip_tensor_list", "selector"}),
    ("/load_lora_adapter", "load_lora_adapter", {"lora_name", "lora_path", "pinned"}),
    ("/unload_lora_adapter", "unload_lora_adapter", {"lora_name"}),
    # miles-only (no SGLang counterpart): the shared-memory weight window, see miles.engines.local.window
    ("/weight_window_layout", "weight_window_layout", set()),
    (
        "/update_weights_from_window",
        "update_weights_from_window",
        {"path", "layout_digest", "flush_cache", "weight_version", "resume_tags", "checksums"},
    ),
]
_GROUP_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
# SGLang marks these ADMIN_OPTIONAL (sglang/srt/entrypoints/http_server.py); every other route is NORMAL.
ADMIN_PATHS = frozenset([p for p, _, _ in _ADMIN_POSTS] + ["/init_weights_update_group"])


def _bearer_matches(header: str | None, key: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and hmac.compare_digest(parts[1], key)


def auth_allowed(path: str, header: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """SGLang's decision for NORMAL and ADMIN_OPTIONAL endpoints (sglang/srt/utils/auth.py)."""
    if path.startswith(("/health", "/ready", "/metrics")):
        return True
    if path in ADMIN_PATHS:
        if admin_api_key:
            return _bearer_matches(header, admin_api_key)
        return _bearer_matches(header, api_key) if api_key else True
    return _bearer_matches(header, api_key) if api_key else True


async def _json_body(request: Request, path: str, fields: set[str]) -> dict[str, JSON]:
    """The JSON object of a request (empty body: {}); ValueError naming the problem."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise ValueError(f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ValueError(f"unknown fields {unknown} for {path}; allowed: {sorted(fields)}")
    return body


def _fail(status: int, message: str, admin: bool) -> JSONResponse:
    body = {"success": False, "message": message} if admin else {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


async def _await(fut: Future[T], timeout: float) -> T:
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)


class _ClientGone(Exception):
    """The HTTP client went away before its generation finished."""


def _when_all_done(futs: list[Future[T]]) -> asyncio.Future[list[T]]:
    """An asyncio future of the results of `futs` (the engine thread's), set once the last of them is done: one
    hop to the event loop per request instead of one per item of a batch (64 wake-ups of the loop, each waking
    a gather, cost ~1 ms per batch of 64 on a busy CPU). Fails with the first error in `futs`' order."""
    loop = asyncio.get_running_loop()
    out: asyncio.Future[list[T]] = loop.create_future()
    left = len(futs)
    lock = threading.Lock()

    def settle() -> None:
        if out.done():  # cancelled (deadline, client gone)
            return
        for f in futs:
            error = f.exception()
            if error is not None:
                out.set_exception(deliverable(error))
                return
        out.set_result([f.result() for f in futs])

    def one_done(_: Future[T]) -> None:
        nonlocal left
        with lock:
            left -= 1
            last = left == 0
        if last:
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the server's loop closed (shutdown) while the engine finished the batch
                pass

    if not futs:
        out.set_result([])
    for f in futs:
        f.add_done_callback(one_done)
    return out


async def _wait_or_disconnect(
    request: Request, futs: list[Future[GenerateAnswer]], timeout: float
) -> list[GenerateAnswer]:
    """Results of `futs`; raises _ClientGone when the client disconnects, TimeoutError after `timeout`."""
    gathered = _when_all_done(futs)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            gathered.cancel()
            raise asyncio.TimeoutError
        done, _ = await asyncio.wait({gathered}, timeout=min(0.5, remaining))
        if done:
            return gathered.result()
        if await request.is_disconnected():
            gathered.cancel()
            raise _ClientGone


class _KeyMiddleware:
    """ASGI middleware applying `auth_allowed` (plain ASGI, so client-disconnect events still reach handlers)."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app, self.api_key, self.admin_api_key = app, api_key, admin_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            header = headers.get(b"authorization", b"").decode("latin-1") or None
            if not auth_allowed(scope["path"], header, self.api_key, self.admin_api_key):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    engine: LocalEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    request_timeout: float = 600.0,
    admin_timeout: float = 300.0,
    admin_api_key: str | None = None,
) -> FastAPI:
    """Build the FastAPI app serving `engine`."""
    app = FastAPI(title="miles embedded engine")

    if api_key or admin_api_key:
        app.add_middleware(_KeyMiddleware, api_key=api_key, admin_api_key=admin_api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        try:
            _, futs, _ = engine.submit_generate(
                {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            )
            await _await(futs[0], admin_timeout)
        except EngineNotReady as e:
            return _fail(503, str(e), admin=False)
        return JSONResponse({})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse(engine.model_info())

    @app.get("/v1/models")
    async def v1_models() -> JSONResponse:
        return JSONResponse(engine.model_cards())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        return JSONResponse(engine.server_info(host, port))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        """Joins the group on a thread of its own: waiting for peers never holds up generation."""
        path = "/init_weights_update_group"
        try:
            body = await _json_body(request, path, _GROUP_FIELDS)
            result = await asyncio.wait_for(
                asyncio.to_thread(engine.join_update_group, GroupRequest.from_json(body)), admin_timeout
            )
        except (ValueError, TypeError) as e:
            return _fail(400, f"{path}: {e}", admin=True)
        except asyncio.TimeoutError:
            return _fail(504, f"{path}: not done within {admin_timeout} s", admin=True)
        except Exception as e:  # noqa: BLE001 - e.g. the rendezvous timed out: the peers never joined
            return _fail(
                400, f"Failed to initialize custom process group: {type(e).__name__}: {e}.", admin=True
            )
        return JSONResponse(result)

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        return JSONResponse([{"dp_rank": 0, **engine.scheduler.load()}])

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object")
            rids, futs, is_batch = engine.submit_generate(body)
        except EngineNotReady as e:
            return _fail(503, str(e), admin=False)
        except ValueError as e:
            return _fail(400, str(e), admin=False)
        try:
            results = await _wait_or_disconnect(request, futs, request_timeout)
        except _ClientGone:
            for rid in rids:
                engine.run("abort", rid=rid)
            return _fail(499, "client disconnected; request aborted", admin=False)
        except EngineNotReady as e:
            return _fail(503, str(e), admin=False)
        except ValueError as e:
            return _fail(400, str(e), admin=False)
        except asyncio.TimeoutError:
            for rid in rids:
                engine.run("abort", rid=rid)
            return _fail(504, f"generation did not finish within {request_timeout} s; aborted", admin=False)
        except Exception as e:  # noqa: BLE001 - a failed model step: answer JSON instead of dropping the connection
            logger.exception("/generate failed")
            return _fail(500, f"{type(e).__name__}: {e}", admin=False)
        return JSONResponse(results if is_batch else results[0])

    def add_admin(path: str, op: str, fields: set[str]) -> None:
        async def handler(request: Request) -> JSONResponse:
            try:
                body = await _json_body(request, path, fields)
                result = await _await(engine.run(op, **body), admin_timeout)
            except RefitRefused as e:
                return _fail(400, str(e), admin=True)
            except (ValueError, TypeError, OSError) as e:
                return _fail(400, f"{path}: {type(e).__name__}: {e}", admin=True)
            except EngineNotReady as e:
                return _fail(503, f"{path}: {e}", admin=True)
            except asyncio.TimeoutError:
                return _fail(504, f"{path}: not done within {admin_timeout} s", admin=True)
            except Exception as e:  # noqa: BLE001 - answer JSON instead of dropping the connection
                logger.exception("%s failed", path)
                return _fail(500, f"{path}: {type(e).__name__}: {e}", admin=True)
            return JSONResponse(result)

        app.add_api_route(
            path, handler, methods=["POST"] if path != "/get_weights_by_name" else ["GET", "POST"]
        )

    for path, op, fields in _ADMIN_POSTS:
        add_admin(path, op, fields)
    return app
