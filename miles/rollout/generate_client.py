"""The rollout side's async generation client (`GenerateClient`): the one HTTP client the rollout talks to the
engines with, for generation and aborts. Engine control (memory, weights, health) goes elsewhere: the driver's
synchronous calls through `miles.utils.engine_control_http`, the trainer's refit calls through
`miles.refit.engine_endpoints`.

It knows the router URL, the engine URLs (aborts go to every engine), the API key and the deadlines. Every error
names the phase, the endpoint (engine or router URL) and, for a generate request, the sample index. Use it as an
async context manager inside the event loop that uses it (the rollout runner keeps one open for its lifetime).

Where generation goes: by default straight to an engine, not through sglang-router (with one engine the router
would only forward; and it refuses SGLang's batch form: one rid and one sampling_params per request). With several
engines each request (a batch counts once) goes to the engine with the fewest generations in flight from this
client, ties broken round robin. With `via_router` (the run asked for a router policy or named a running router,
see `miles.engines.router.generation_via_router`) every generation goes to `{router}/generate` alone (never
batched) and the router picks the engine; the router's own retries and the client's retry of 502/503/504 within
the request deadline stand in for the set-aside below, which is the direct path's alone.

Which engines may take a request (fault tolerance without the router hop): the router's worker list stays the
registry of admitted engines (the health monitor takes a dead engine out of it before restarting it and puts it
back after its refit), so the client reads `GET {router}/workers` at most once a second while it sends. An engine
that refuses a connection, drops one, or answers 502/503/504 is set aside at once and the request goes to
another engine; a set-aside engine is taken again once the router no longer lists it (from then on the router's
list decides: it comes back when readmitted) or once it answers `/health` while the router still lists it (a
transient failure: the monitor takes an engine out of the router before it restarts one, so an engine that
answers while listed was never restarted). With no engine to take, or when every engine that may take it has
failed it since the last wait, the request waits with backoff (0.2 s doubling, at most 5 s). The deadline
(`--rollout-request-timeout`) is checked before every attempt: an engine that keeps answering 503 while its
/health answers 200 (SGLang retracting requests under memory pressure) ends the request at its deadline with an
error naming the engine and its last answer. Without a router worker list (a fake or single server), only the
health probe brings an engine back.

POSTs over plain http (generation, pause / continue, aborts) go through `miles.rollout.lean_http` (asyncio
streams: a tenth of httpx's CPU per request); GETs, https and a test's `transport` through httpx.

Request batching (`miles.rollout.generate_batching`): `generate` calls made under the same `batching` key in the
same event-loop turn go out as one SGLang batch request; calls outside `batching`, and every call through the
router, go alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

from miles.rollout.generate_batching import Batch, current_batch, split_evenly
from miles.rollout.generate_output import ABORTED_BEFORE_SENDING, GenerateOutput, request_seed
from miles.rollout.lean_http import LeanPoster, LeanResponse
from miles.rollout.vl_request import image_data_field
from miles.utils.engine_control_http import bearer
from miles.utils.hang_dump import expired
from miles.utils.httpx_import import lean_httpx

with lean_httpx():  # not its command-line client's imports (~0.1 s of CPU per process)
    import httpx

logger = logging.getLogger(__name__)

# Answers that mean "no engine could take it right now" (the router has no live worker, a worker restarts, a
# gateway lost its upstream): retried with backoff until the request's deadline.
TRANSIENT_STATUSES = frozenset({502, 503, 504})
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.2, 5.0


async def expired_in_thread(message: str, stalled: str) -> str:
    """`miles.utils.hang_dump.expired` (the stacks of every miles process, for a request past its deadline) off the
    event loop: the dump waits a few seconds for the other processes."""
    return await asyncio.to_thread(expired, message, stalled)


class EngineError(RuntimeError):
    """An engine or the router answered with an error, did not answer in time, or could not be reached."""


class EngineUnavailable(EngineError):
    """`post(..., retry=False)` found the server unreachable or answering 502/503/504 (worth trying elsewhere)."""


ENGINE_LIST_TTL_S = 1.0  # how old the router's worker list may get while requests are sent
PROBE_TIMEOUT_S = 2.0  # one /health probe of a set-aside engine, or one read of the router's worker list
# How long an idle pooled connection to an engine may be reused. It must stay well below the engines' own
# keep-alive timeout (uvicorn's default 5 s: SGLang's SGLANG_TIMEOUT_KEEP_ALIVE and the embedded engine): with
# httpx's default (also 5 s) a connection idle for ~5 s is reused just as the engine closes it, and the request
# dies with ReadError (a busy engine or rollout loop widens that window; a rollout of ~5 s hit it ~10 times).
KEEPALIVE_EXPIRY_S = 2.0


@dataclass
class _Queued:
    """One generate call waiting to be sent (alone or in a batch)."""

    input_ids: list[int]
    sampling_params: dict
    rid: str | None
    sample_index: int
    phase: str
    future: asyncio.Future = field(repr=False)
    image_data: list[str] | None = None  # the prompt's images (miles.rollout.vl_request)


class GenerateClient:
    """Async client for the engines behind one router.

    `generate` holds at most `concurrency` requests in flight and waits at most `timeout` seconds for each.
    After `stop_new_requests()`, requests not yet sent return an aborted empty output without reaching an
    engine (used with `abort_all` when a partial rollout is cut short).
    """

    def __init__(
        self,
        router_url: str,
        engine_urls: list[str],
        api_key: str | None,
        timeout: float,
        concurrency: int,
        transport: httpx.AsyncBaseTransport | None = None,
        seed: int | None = None,
        via_router: bool = False,
        return_routed_experts: bool = False,
    ) -> None:
        """`transport` replaces the network (tests pass an `httpx.MockTransport` serving a fake engine); with
        `seed`, a request with a `rid` gets `sampling_params.sampling_seed = request_seed(seed, rid)`; with
        `via_router`, generation goes through the router (see the module docstring)."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.router_url = router_url.rstrip("/")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.timeout = float(timeout)
        self.concurrency = max(1, int(concurrency))
        self._headers = bearer(api_key)
        self._http: httpx.AsyncClient | None = None
        self._lean: LeanPoster | None = None  # POSTs over plain http without a test transport (lean_http)
        self._limiter: asyncio.Semaphore | None = None
        self._stopped = False
        self._transport = transport
        self.seed = seed
        self.via_router = via_router
        self.return_routed_experts = return_routed_experts  # R3: every request asks for the routed experts
        if not self.engine_urls:
            raise ValueError("GenerateClient needs at least one engine URL")
        self._in_flight = [0] * len(self.engine_urls)  # generations sent to each engine and not yet answered
        self._next_engine = 0
        self._set_aside: set[int] = set()  # engines that failed a request (see the module docstring)
        self._unlisted: set[int] = set()  # engines the router's worker list lacks (taken out by the monitor)
        self._listed_at = float("-inf")  # when the router's worker list was last read
        self._queues: dict[Batch, list[_Queued]] = {}
        self._sending: set[asyncio.Task] = set()
        self.requests_sent = 0  # POST /generate requests (a batch counts once)
        self.lora_path: str | None = None  # --lora-refit adapter: every request's adapter (set by the runner)
        # awaited when the client closes: services started on it (the session server) stop with it
        self.on_close: list[Callable[[], Awaitable[None]]] = []

    async def __aenter__(self) -> GenerateClient:
        limits = httpx.Limits(
            max_connections=self.concurrency + 8,
            max_keepalive_connections=self.concurrency,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        self._http = httpx.AsyncClient(
            limits=limits, timeout=self.timeout, headers=self._headers, transport=self._transport
        )
        self._lean = LeanPoster(self._headers, KEEPALIVE_EXPIRY_S) if self._transport is None else None
        self._limiter = asyncio.Semaphore(self.concurrency)
        self._stopped = False
        return self

    def resume(self) -> None:
        """Accept new requests again after `stop_new_requests` (the next rollout on a long-lived client)."""
        self._stopped = False

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        while self.on_close:
            await self.on_close.pop()()
        if self._http is not None:
            await self._http.aclose()
        if self._lean is not None:
            await self._lean.aclose()
        self._http = self._lean = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("GenerateClient used outside `async with`")
        return self._http

    # ------------------------------------------------------------------------------------------ requests
    async def post(
        self,
        url: str,
        body: dict,
        phase: str,
        what: str = "",
        retry: bool = True,
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> dict:
        """POST `body` to `url` and return the JSON answer; EngineError naming phase, URL and `what` otherwise.

        A connection error or a 502/503/504 is retried with exponential backoff (0.2 s doubling, at most 5 s)
        until `timeout` (default: the request deadline) has passed since the first attempt, or until `deadline`
        (a `time.monotonic()` instant: the caller's own request deadline) when given; the deadline covers every
        attempt together. With `retry`, a request that failed for good also names the engines that do not
        answer /health (the likely culprits behind the router)."""
        suffix = f" ({what})" if what else ""
        budget = self.timeout if timeout is None else float(timeout)
        if deadline is None:
            deadline = time.monotonic() + budget
        backoff, attempt = BACKOFF_FIRST_S, 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            problem = ""
            resp: httpx.Response | LeanResponse | None
            try:
                if self._lean is not None and self._lean.takes(url):
                    resp = await self._lean.post(url, body, max(left, 0.01))
                else:
                    resp = await self.http.post(url, json=body, timeout=max(left, 0.01))
            except httpx.TimeoutException as e:
                stuck = await self.unresponsive_engines() if retry else []
                culprit = f"; engines not answering /health: {stuck}" if stuck else ""
                message = (
                    f"{phase}: no answer from {url} within the request deadline ({budget:g}s){suffix} "
                    f"(attempt {attempt}){culprit}"
                )
                raise EngineError(await expired_in_thread(message, f"engines {stuck or [url]}")) from e
            except httpx.HTTPError as e:
                problem = f"cannot reach {url}: {type(e).__name__}: {e}"
                resp = None
            if resp is not None:
                if resp.status_code == 200:
                    break
                problem = f"{url} answered {resp.status_code}: {resp.text[:500]}"
                if resp.status_code not in TRANSIENT_STATUSES:
                    raise EngineError(f"{phase}: {problem}{suffix}")
            if not retry:
                raise EngineUnavailable(f"{phase}: {problem}{suffix}")
            if time.monotonic() + backoff >= deadline:
                stuck = await self.unresponsive_engines()
                culprit = f"; engines not answering /health: {stuck}" if stuck else ""
                message = (
                    f"{phase}: {problem}{suffix} (gave up after {attempt} attempt(s) in {budget:g}s){culprit}"
                )
                raise EngineError(await expired_in_thread(message, f"engines {stuck or [url]}"))
            logger.warning("%s: %s%s; retrying in %.1fs", phase, problem, suffix, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
        if not resp.content.strip():  # SGLang's /abort_request answers 200 with an empty body
            return {}
        try:
            return resp.json()
        except ValueError as e:
            raise EngineError(f"{phase}: {url} answered non-JSON{suffix}: {resp.text[:200]!r}") from e

    async def unresponsive_engines(self, timeout: float = 5.0) -> list[str]:
        """The engine URLs whose GET /health does not answer 200 within `timeout` seconds (for error messages)."""

        async def dead(url: str) -> bool:
            try:
                return (await self.http.get(f"{url}/health", timeout=timeout)).status_code != 200
            except httpx.HTTPError:
                return True

        flags = await asyncio.gather(*(dead(u) for u in self.engine_urls))
        return [u for u, bad in zip(self.engine_urls, flags) if bad]

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        sample_index: int,
        phase: str,
        rid: str | None = None,
        image_data: list[str] | None = None,
    ) -> GenerateOutput:
        """One generation (prompt as `input_ids`, log-probs requested; `rid` names the request, which engines
        also seed its sampling from), sent alone or in a batch with the other calls of its `batching` key;
        `image_data`: the prompt's images (one `<|image_pad|>` each in `input_ids`, see `vl_request`)."""
        if self._stopped:
            return ABORTED_BEFORE_SENDING
        assert self._limiter is not None, "GenerateClient used outside `async with`"
        async with self._limiter:
            if self._stopped:
                return ABORTED_BEFORE_SENDING
            if rid is not None and self.seed is not None and "sampling_seed" not in sampling_params:
                sampling_params = {**sampling_params, "sampling_seed": request_seed(self.seed, rid)}
            batch = None if self.via_router else current_batch()  # the router takes no batch form
            future = asyncio.get_running_loop().create_future()
            item = _Queued(list(input_ids), sampling_params, rid, sample_index, phase, future, image_data)
            if batch is None:
                await self._send([item])
            else:
                queue = self._queues.setdefault(batch, [])
                queue.append(item)
                if len(queue) == 1:  # the first of its batch: flush once no more arrive
                    asyncio.get_running_loop().call_soon(self._flush_when_settled, batch, 1)
            return await item.future

    def _flush_when_settled(self, batch: Batch, seen: int) -> None:
        """Send `batch`'s queue once an event-loop turn passes without a new arrival."""
        queue = self._queues.get(batch, [])
        if len(queue) > seen:
            asyncio.get_running_loop().call_soon(self._flush_when_settled, batch, len(queue))
            return
        items = self._queues.pop(batch, [])
        parts = self._engines_to_take() if batch.per_engine else 1
        for chunk in split_evenly(items, parts) if items else []:
            task = asyncio.ensure_future(self._send(chunk))
            self._sending.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self._sending.discard)

    def _engines_to_take(self) -> int:
        """How many engines a batch is spread over: those neither set aside nor out of the router (at least 1:
        with none, each request waits for one to come back)."""
        n = len(self.engine_urls)
        return max(1, sum(i not in self._set_aside and i not in self._unlisted for i in range(n)))

    async def _send(self, items: list[_Queued]) -> None:
        """POST `items` (one request, a batch when several) and resolve each item's future with its output
        or the error. Items queued when `stop_new_requests` came are answered aborted without sending."""
        if self._stopped:
            for it in items:
                _resolve(it.future, ABORTED_BEFORE_SENDING)
            return
        phase, what = items[0].phase, _samples_text([it.sample_index for it in items])
        single = len(items) == 1
        payload: dict = {
            "input_ids": items[0].input_ids if single else [it.input_ids for it in items],
            "sampling_params": items[0].sampling_params if single else [it.sampling_params for it in items],
            "return_logprob": True,
            **image_data_field([it.image_data for it in items], single),
        }
        if self.return_routed_experts:
            payload["return_routed_experts"] = True
        rids = [it.rid for it in items]
        if any(r is not None for r in rids):
            if not all(r is not None for r in rids):
                rids = [r if r is not None else f"{rids[0]}-b{i}" for i, r in enumerate(rids)]
            payload["rid"] = rids[0] if single else rids
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        try:
            if self.via_router:
                url = f"{self.router_url}/generate"
                self.requests_sent += 1
                body = await self.post(url, payload, phase, what)
            else:
                url, body = await self._post_to_an_engine(payload, len(items), phase, what)
            answers = [body] if single else body
            if not isinstance(answers, list) or len(answers) != len(items):
                raise EngineError(
                    f"{phase}: {url} answered a batch of {len(items)} ({what}) with "
                    f"{len(answers) if isinstance(answers, list) else type(answers).__name__} items"
                )
            outs = []
            for it, answer in zip(items, answers):
                try:
                    outs.append(
                        GenerateOutput.from_response(answer, f"{phase}: {url} (sample {it.sample_index})")
                    )
                except ValueError as e:
                    raise EngineError(str(e)) from e
        except Exception as e:  # noqa: BLE001 - every waiting caller gets the error
            for it in items:
                if not it.future.done():
                    it.future.set_exception(e)
            return
        except BaseException:  # cancelled (the loop is closing): the callers are cancelled too
            for it in items:
                it.future.cancel()
            raise
        for it, out in zip(items, outs):
            _resolve(it.future, out)

    async def _post_to_an_engine(self, payload: dict, n: int, phase: str, what: str) -> tuple[str, dict]:
        """POST /generate `payload` (`n` generations) to an engine that may take it, trying another one when an
        engine is unavailable, within one request deadline; returns the engine URL that answered and its body.

        The deadline is checked before every attempt, whatever brought the engine back: SGLang answers 503
        (e.g. "Retracted under decode memory pressure ... Retry later") while its `/health` answers 200, so an
        engine set aside is readmitted by its health probe on the next pass. Once every engine that may take the
        request failed it since the last wait, the next attempt waits with backoff first (never a tight loop).
        Giving up names the engine and its last answer."""
        deadline = time.monotonic() + self.timeout
        backoff, attempt = BACKOFF_FIRST_S, 0
        problem = f"{phase}: no engine to send {what} to (none listed by the router {self.router_url})"
        failed: set[int] = set()  # engines that failed this request since the last wait
        while True:
            if time.monotonic() >= deadline:
                raise await self._gave_up(problem, attempt)
            await self._refresh_engines(deadline)
            engine = self._pick_engine(exclude=failed)
            if engine is None:  # wait for an engine to come back (or to recover)
                if time.monotonic() + backoff >= deadline:
                    raise await self._gave_up(problem, attempt)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                failed.clear()
                self._listed_at = float("-inf")  # look again now
                continue
            url = f"{self.engine_urls[engine]}/generate"
            attempt += 1
            self._in_flight[engine] += n
            self.requests_sent += 1
            try:
                return url, await self.post(url, payload, phase, what, retry=False, deadline=deadline)
            except EngineUnavailable as e:
                problem = str(e)
                failed.add(engine)
                self._set_aside.add(engine)
                logger.warning("%s; setting engine %s aside and trying another", e, self.engine_urls[engine])
            finally:
                self._in_flight[engine] -= n

    async def _gave_up(self, problem: str, attempts: int) -> EngineError:
        """The error of a request whose deadline passed: its last problem (engine and answer), the attempts, and
        the engines that do not answer /health."""
        stuck = await self.unresponsive_engines()
        culprit = f"; engines not answering /health: {stuck}" if stuck else ""
        message = f"{problem} (gave up after {attempts} attempt(s) in {self.timeout:g}s, the request deadline){culprit}"
        return EngineError(await expired_in_thread(message, f"engines {stuck or self.engine_urls}"))

    async def _refresh_engines(self, deadline: float) -> None:
        """Read the router's worker list (at most once per ENGINE_LIST_TTL_S) and take back set-aside engines
        that left it or that answer /health while still listed (see the module docstring); each probe waits at
        most 2 s and not past `deadline` (the calling request's)."""
        if time.monotonic() - self._listed_at < ENGINE_LIST_TTL_S:
            return
        self._listed_at = time.monotonic()
        wait = min(PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.01))
        aside = sorted(self._set_aside)
        healthy = await asyncio.gather(*(self._answers_health(self.engine_urls[i], wait) for i in aside))
        listed = await self._router_workers(wait)  # read after the probes: see the module docstring
        if listed is None:
            self._unlisted = set()
        else:
            self._unlisted = {i for i, u in enumerate(self.engine_urls) if u not in listed}
        for i, ok in zip(aside, healthy):
            if i in self._unlisted or ok:
                self._set_aside.discard(i)

    async def _answers_health(self, url: str, timeout: float) -> bool:
        try:
            return (await self.http.get(f"{url}/health", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _router_workers(self, timeout: float) -> set[str] | None:
        """The worker URLs sglang-router lists (`GET /workers`); None when there is no such list to read."""
        if self.router_url in self.engine_urls:
            return None
        try:
            resp = await self.http.get(f"{self.router_url}/workers", timeout=timeout)
            if resp.status_code != 200:
                return None
            body = resp.json()
            if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
                return None
            return {str(w["url"]).rstrip("/") for w in body["workers"]}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _pick_engine(self, exclude: set[int] | frozenset[int] = frozenset()) -> int | None:
        """Of the engines that may take a request (and are not in `exclude`), the one with the fewest generations
        in flight; ties go round robin. None when every engine is set aside, out of the router or excluded."""
        n = len(self.engine_urls)
        order = [
            i
            for i in ((self._next_engine + k) % n for k in range(n))
            if i not in self._set_aside and i not in self._unlisted and i not in exclude
        ]
        if not order:
            return None
        engine = min(order, key=lambda i: self._in_flight[i])
        self._next_engine = (engine + 1) % n
        return engine

    # ------------------------------------------------------------------------------------------ aborts
    @property
    def stopped(self) -> bool:
        """Whether `stop_new_requests` was called."""
        return self._stopped

    def stop_new_requests(self) -> None:
        """From now on `generate` answers an aborted empty output instead of sending the request."""
        self._stopped = True

    async def abort_all(self, phase: str) -> None:
        """POST /abort_request {"abort_all": true} to every engine: in-flight requests return what they have.

        An engine that cannot be reached or does not answer within 10 s is skipped with a warning (its requests
        die with it, or end at their own deadline); an engine that answers with an error fails the call."""

        async def one(url: str) -> None:
            try:
                await self.post(f"{url}/abort_request", {"abort_all": True}, phase, retry=False, timeout=10.0)
            except EngineError as e:
                if not isinstance(e.__cause__, httpx.TimeoutException) and "cannot reach" not in str(e):
                    raise
                logger.warning("%s: skipping engine %s, which does not answer: %s", phase, url, e)

        await asyncio.gather(*(one(url) for url in self.engine_urls))


def _resolve(future: asyncio.Future, value: GenerateOutput) -> None:
    if not future.done():
        future.set_result(value)


def _samples_text(indices: list[int]) -> str:
    """'sample 3' or 'samples 3, 4, 5 ...' for error messages."""
    if len(indices) == 1:
        return f"sample {indices[0]}"
    shown = ", ".join(str(i) for i in indices[:8])
    return f"samples {shown}{' ...' if len(indices) > 8 else ''} (batch of {len(indices)})"
