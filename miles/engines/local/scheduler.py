"""Continuous batching for the embedded engine.

One thread owns the model. Each iteration it (1) runs queued commands (weight updates, aborts, memory release:
anything that must not interleave with a forward pass), (2) admits waiting requests up to the running-request and
token budgets, prefilling each and sampling its first token, then (3) runs ONE batched decode step over every
running request. A request leaves the batch as soon as it finishes (EOS unless ignore_eos, stop_token_ids, stop
strings, max_new_tokens, abort); the others go on. Results are delivered through `concurrent.futures.Future`s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.engines.local.sampling import SamplingParams, request_generator, sample_token
from miles.engines.local.weights import EngineNotReady

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """One generation request and its progress."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    generator: torch.Generator
    future: Future = field(default_factory=Future)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cache: Any = None
    finish_reason: dict[str, Any] | None = None
    stop_text_end: int | None = None  # where a matched stop string starts in the decoded text
    return_text_in_logprobs: bool = False
    created: float = field(default_factory=time.monotonic)

    @property
    def budget(self) -> int:
        """KV tokens this request may occupy."""
        return len(self.input_ids) + self.params.max_new_tokens


class Scheduler:
    """The scheduler thread and its queues; the callables passed in supply the model pieces (see `LocalEngine`)."""

    def __init__(
        self,
        runner_fn: Callable[[], Any],
        tokenizer: Any,
        eos_ids: set[int],
        check_ready: Callable[[], None],
        weight_version_fn: Callable[[], str],
        max_running_requests: int = 64,
        max_total_tokens: int | None = None,
        random_seed: int = 0,
    ):
        if max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {max_running_requests}")
        if max_total_tokens is not None and max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens must be >= 1, got {max_total_tokens}")
        self._runner_fn = runner_fn
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self._check_ready = check_ready
        self._weight_version_fn = weight_version_fn
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.random_seed = random_seed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self.paused: str | None = None  # None, "abort" or "in_place"
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "decode_seconds": 0.0, "prefill_tokens": 0}
        self._thread = threading.Thread(target=self._loop, name="miles-local-scheduler", daemon=True)

    # ---------------------------------------------------------------- API used from other threads
    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (in-flight requests are aborted)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        return_logprob: bool,
        return_text_in_logprobs: bool = False,
    ) -> Future:
        """Queue a request; its future resolves to the SGLang-style answer dict."""
        if not input_ids:
            raise ValueError("empty prompt: input_ids/text must contain at least one token")
        if (
            self.max_total_tokens is not None
            and len(input_ids) + params.max_new_tokens > self.max_total_tokens
        ):
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"--max-total-tokens={self.max_total_tokens}"
            )
        self._check_ready()
        req = Request(
            rid,
            list(input_ids),
            params,
            return_logprob,
            request_generator(self.random_seed, rid, params.sampling_seed),
        )
        req.return_text_in_logprobs = return_text_in_logprobs
        with self._cond:
            # a finished request may still sit in `running` until the end of the step that finished it
            if any(r.rid == rid and r.finish_reason is None for r in (*self.waiting, *self.running)):
                raise ValueError(f"duplicate rid {rid!r}: a request with this id is in flight")
            self.waiting.append(req)
            self._cond.notify_all()
        return req.future

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the scheduler thread between forward passes; the future gets its result."""
        fut: Future = Future()
        with self._cond:
            self._commands.append((fn, fut))
            self._cond.notify_all()
        return fut

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """Abort one request (by rid) or all; call on the scheduler thread (through `call`). Returns the count."""
        with self._cond:
            victims = [r for r in (*self.waiting, *self.running) if abort_all or r.rid == rid]
            for r in victims:
                self._finish(r, {"type": "abort", "message": message})
            self.waiting = deque(r for r in self.waiting if r.finish_reason is None)
            self.running = [r for r in self.running if r.finish_reason is None]
        return len(victims)

    def set_paused(self, mode: str | None) -> None:
        """Pause ("abort": in-flight requests are aborted; "in_place": they are held) or resume (None)."""
        if mode not in (None, "abort", "in_place"):
            raise ValueError(f"pause mode {mode!r} not supported; allowed: 'abort', 'in_place'")
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by pause_generation")
        self.paused = mode

    def load(self) -> dict[str, int]:
        """Queue sizes for /get_server_info and /get_load."""
        running = sum(r.finish_reason is None for r in self.running)
        return {"num_waiting": len(self.waiting), "num_running": running}

    # ---------------------------------------------------------------- scheduler thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._has_work():
                    self._cond.wait(timeout=0.5)
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, fut in commands:
                self._run_command(fn, fut)
            if self.paused:
                continue
            self._admit()
            if self.running:
                try:
                    self._decode_step()
                except Exception as e:  # noqa: BLE001 - a model failure must fail the batch, not hang it
                    logger.exception("decode step failed; failing %d running requests", len(self.running))
                    failed, self.running = self.running, []
                    for r in failed:
                        if not r.future.done():
                            r.future.set_exception(e)
        self.abort(abort_all=True, message="server shutting down")
        for _fn, fut in self._commands:
            fut.set_exception(RuntimeError("server shutting down"))

    def _has_work(self) -> bool:
        if self._commands:
            return True
        if self.paused:
            return False
        return bool(self.running) or (bool(self.waiting) and self._can_admit(self.waiting[0]))

    @staticmethod
    def _run_command(fn: Callable[[], Any], fut: Future) -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            fut.set_exception(e)

    def _reserved_tokens(self) -> int:
        return sum(r.budget for r in self.running)

    def _can_admit(self, req: Request) -> bool:
        if len(self.running) >= self.max_running_requests:
            return False
        return self.max_total_tokens is None or self._reserved_tokens() + req.budget <= self.max_total_tokens

    def _admit(self) -> None:
        runner = self._runner_fn()
        while self.waiting and self._can_admit(self.waiting[0]):
            with self._cond:
                req = self.waiting.popleft()
            try:
                self._check_ready()
            except EngineNotReady as e:
                req.future.set_exception(e)
                continue
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            req.cache = runner.new_cache()
            try:
                logits = runner.prefill(req.input_ids, req.cache)
                finish = self._append_token(req, logits)
            except Exception as e:  # noqa: BLE001 - fail this request only
                logger.exception("prefill of request %s failed", req.rid)
                req.future.set_exception(e)
                continue
            self.stats["prefill_tokens"] += len(req.input_ids)
            if finish is None:
                self.running.append(req)
            else:
                self._finish(req, finish)

    def _decode_step(self) -> None:
        runner = self._runner_fn()
        t0 = time.perf_counter()
        logits = runner.decode([r.output_ids[-1] for r in self.running], [r.cache for r in self.running])
        self.stats["decode_seconds"] += time.perf_counter() - t0
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(self.running)
        done = [(req, self._append_token(req, logits[i])) for i, req in enumerate(self.running)]
        # leave the batch first, then answer: a client's next request must not see its old one as running
        self.running = [req for req, finish in done if finish is None]
        for req, finish in done:
            if finish is not None:
                self._finish(req, finish)

    def _append_token(self, req: Request, logits: torch.Tensor) -> dict[str, Any] | None:
        """Sample the next token of `req`; returns its finish reason when the request is done."""
        token, logprob = sample_token(logits, req.params, req.generator)
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        return self._check_stop(req, token)

    def _check_stop(self, req: Request, token: int) -> dict[str, Any] | None:
        p = req.params
        if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            return {"type": "stop", "matched": token}
        if p.stop and self._stop_in_tail(req.output_ids, p):
            text = self._decode(req.output_ids, p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                start, s = min(hits)
                req.stop_text_end = start
                return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    def _stop_in_tail(self, ids: list[int], p: Any) -> bool:
        """Whether a stop string may have just completed: checked on the last few tokens only, so a long
        generation is not re-decoded whole at every step. A string that was not there before this token ends
        in it and spans at most 4 tokens per character (byte-level pieces), plus one partial character. With
        skip_special_tokens, tokens may decode to nothing, so the whole output is checked."""
        if p.skip_special_tokens:
            return True
        window = 4 * max(len(s) for s in p.stop) + 4
        tail = self._decode(ids[-window:], False)
        return any(s in tail for s in p.stop)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _finish(self, req: Request, finish_reason: dict[str, Any]) -> None:
        req.finish_reason = finish_reason
        req.cache = None
        if not req.future.done():
            req.future.set_result(self._answer(req))

    def _answer(self, req: Request) -> dict[str, Any]:
        p, fr = req.params, req.finish_reason
        ids = req.output_ids
        if fr["type"] == "stop" and isinstance(fr.get("matched"), int) and not p.no_stop_trim:
            text = self._decode(ids[:-1], p.skip_special_tokens)
        else:
            text = self._decode(ids, p.skip_special_tokens)
            if req.stop_text_end is not None and not p.no_stop_trim:
                text = text[: req.stop_text_end]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": fr,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": self._weight_version_fn(),
            "e2e_latency": time.monotonic() - req.created,
        }
        if req.return_logprob:
            texts = (
                [self._decode([t], False) for t in ids] if req.return_text_in_logprobs else [None] * len(ids)
            )
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(req.logprobs, ids, texts)]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}
