"""The one async HTTP client the rollout side talks to the engines with.

It knows the router URL (generation goes through sglang-router), the engine URLs (aborts go to every engine),
the API key and the deadlines. Every error names the phase, the endpoint (engine or router URL) and, for a
generate request, the sample index. Use it as an async context manager inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from types import TracebackType

import httpx

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
# Answers that mean "no engine could take it right now" (the router has no live worker, a worker restarts, a
# gateway lost its upstream): retried with backoff until the request's deadline.
TRANSIENT_STATUSES = frozenset({502, 503, 504})
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.2, 5.0


class EngineError(RuntimeError):
    """An engine or the router answered with an error, did not answer in time, or could not be reached."""


@dataclass(frozen=True)
class GenerateOutput:
    """One /generate answer (SGLang's fields): new token ids, their log-probs, text and why it stopped."""

    output_ids: list[int]
    log_probs: list[float] | None  # [len(output_ids)], None when the engine returned none
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None = None

    @classmethod
    def from_response(cls, body: dict, where: str) -> GenerateOutput:
        """Parse a /generate JSON body; ValueError naming `where` when ids and log-probs disagree."""
        meta = body.get("meta_info") or {}
        logprobs = meta.get("output_token_logprobs")
        output_ids = body.get("output_ids")
        if output_ids is None:  # servers that report the ids only inside the log-prob triples
            output_ids = [int(entry[1]) for entry in logprobs or []]
        if logprobs is not None and len(logprobs) != len(output_ids):
            raise ValueError(f"{where}: {len(output_ids)} output ids but {len(logprobs)} log-probs")
        finish = (meta.get("finish_reason") or {}).get("type", "stop")
        if finish not in FINISH_REASONS:
            raise ValueError(
                f"{where}: unknown finish_reason type {finish!r}; expected one of {FINISH_REASONS}"
            )
        version = meta.get("weight_version")
        return cls(
            output_ids=[int(t) for t in output_ids],
            log_probs=[float(entry[0]) for entry in logprobs] if logprobs is not None else None,
            text=body.get("text", ""),
            finish_reason=finish,
            weight_version=None if version is None else str(version),
        )


def request_seed(seed: int, rid: str) -> int:
    """The `sampling_seed` of request `rid` in a run seeded with `seed` (31 bits: a valid int everywhere).

    Request ids name the rollout, the sample index and the turn, so a sample draws the same tokens whichever
    engine serves it, and in a resumed run as in a straight one."""
    digest = hashlib.sha256(f"{seed}:{rid}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


ABORTED_BEFORE_SENDING = GenerateOutput(output_ids=[], log_probs=[], text="", finish_reason="abort")


class EngineClient:
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
    ) -> None:
        """`transport` replaces the network (tests pass an `httpx.MockTransport` serving a fake engine); with
        `seed`, a request with a `rid` gets `sampling_params.sampling_seed = request_seed(seed, rid)`."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.router_url = router_url.rstrip("/")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.timeout = float(timeout)
        self.concurrency = max(1, int(concurrency))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: httpx.AsyncClient | None = None
        self._limiter: asyncio.Semaphore | None = None
        self._stopped = False
        self._transport = transport
        self.seed = seed

    async def __aenter__(self) -> EngineClient:
        limits = httpx.Limits(
            max_connections=self.concurrency + 8, max_keepalive_connections=self.concurrency
        )
        self._http = httpx.AsyncClient(
            limits=limits, timeout=self.timeout, headers=self._headers, transport=self._transport
        )
        self._limiter = asyncio.Semaphore(self.concurrency)
        self._stopped = False
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._http = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("EngineClient used outside `async with`")
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
    ) -> dict:
        """POST `body` to `url` and return the JSON answer; EngineError naming phase, URL and `what` otherwise.

        A connection error or a 502/503/504 is retried with exponential backoff (0.2 s doubling, at most 5 s)
        until `timeout` (default: the request deadline) has passed since the first attempt; the deadline covers
        every attempt together. With `retry`, a request that failed for good also names the engines that do not
        answer /health (the likely culprits behind the router)."""
        suffix = f" ({what})" if what else ""
        budget = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + budget
        backoff, attempt = BACKOFF_FIRST_S, 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            problem = ""
            try:
                resp = await self.http.post(url, json=body, timeout=max(left, 0.01))
            except httpx.TimeoutException as e:
                stuck = await self.unresponsive_engines() if retry else []
                culprit = f"; engines not answering /health: {stuck}" if stuck else ""
                raise EngineError(
                    f"{phase}: no answer from {url} within {budget:.0f}s{suffix} (attempt {attempt}){culprit}"
                ) from e
            except httpx.HTTPError as e:
                problem = f"cannot reach {url}: {type(e).__name__}: {e}"
                resp = None
            if resp is not None:
                if resp.status_code == 200:
                    break
                problem = f"{url} answered {resp.status_code}: {resp.text[:500]}"
                if resp.status_code not in TRANSIENT_STATUSES:
                    raise EngineError(f"{phase}: {problem}{suffix}")
            if not retry or time.monotonic() + backoff >= deadline:
                stuck = await self.unresponsive_engines() if retry else []
                culprit = f"; engines not answering /health: {stuck}" if stuck else ""
                raise EngineError(
                    f"{phase}: {problem}{suffix} (gave up after {attempt} attempt(s) in {budget:.0f}s){culprit}"
                )
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
    ) -> GenerateOutput:
        """One POST /generate through the router (prompt as `input_ids`, log-probs requested; `rid` names the
        request, which engines also seed its sampling from)."""
        if self._stopped:
            return ABORTED_BEFORE_SENDING
        assert self._limiter is not None, "EngineClient used outside `async with`"
        async with self._limiter:
            if self._stopped:
                return ABORTED_BEFORE_SENDING
            url = f"{self.router_url}/generate"
            payload: dict = {
                "input_ids": list(input_ids),
                "sampling_params": sampling_params,
                "return_logprob": True,
            }
            if rid is not None:
                payload["rid"] = rid
                if self.seed is not None and "sampling_seed" not in sampling_params:
                    payload["sampling_params"] = {
                        **sampling_params,
                        "sampling_seed": request_seed(self.seed, rid),
                    }
            body = await self.post(url, payload, phase, f"sample {sample_index}")
        try:
            return GenerateOutput.from_response(body, f"{phase}: {url} (sample {sample_index})")
        except ValueError as e:
            raise EngineError(str(e)) from e

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
