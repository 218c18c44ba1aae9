"""The embedded engine's loop: one thread that owns the model, around the pure `Scheduler`.

Each iteration it (1) moves newly submitted requests into the scheduler and runs queued commands (weight
updates, aborts, memory release: anything that must not interleave with a forward pass), then (2) asks the
scheduler for a batch, runs it through the model runner, samples one token per sampling row and hands the tokens
back to the scheduler, and (3) answers finished requests through their `concurrent.futures.Future`s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from miles.engines.local.output import GenerateAnswer, OutputProcessor
from miles.engines.local.sampling import SamplingParams, request_rng, sample_batch
from miles.engines.local.scheduler import Batch, Request, Scheduler
from miles.engines.local.weights import EngineNotReady

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from miles.engines.local.model_runner import NoCacheRunner, PoolRunner

logger = logging.getLogger(__name__)


def deliverable(error: BaseException) -> Exception:
    """`error` as a request's future can carry it: asyncio futures refuse StopIteration (TypeError inside the
    callback that copies the result, so the request would wait out its deadline), and a BaseException that is
    not an Exception (KeyboardInterrupt, SystemExit, GeneratorExit) would be re-raised in the server's event loop.
    Those are wrapped in a RuntimeError naming them (the original as its cause); any other Exception is as is."""
    if isinstance(error, Exception) and not isinstance(error, (StopIteration, StopAsyncIteration)):
        return error
    wrapped = RuntimeError(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    wrapped.__cause__ = error
    return wrapped


class EngineLoop:
    """The scheduler thread and its queues; `runner` is a `PoolRunner` or `NoCacheRunner`."""

    def __init__(
        self,
        runner: PoolRunner | NoCacheRunner,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: set[int],
        check_ready: Callable[[], None],
        weight_version_fn: Callable[[], str],
        max_running_requests: int = 64,
        context_length: int | None = None,
        max_total_tokens: int | None = None,
        chunked_prefill_size: int | None = None,
        random_seed: int = 0,
    ):
        self.runner = runner
        self.output = OutputProcessor(tokenizer, weight_version_fn)
        self.context_length = context_length
        capacity = min(x for x in (context_length, max_total_tokens, 1 << 62) if x is not None)
        self.core = Scheduler(
            num_slots=max_running_requests,
            slot_capacity=capacity,
            eos_ids=eos_ids,
            detokenize=self.output.detokenize,
            max_total_tokens=max_total_tokens,
            chunked_prefill_size=chunked_prefill_size,
        )
        self._check_ready = check_ready
        self.random_seed = random_seed
        self._inbox: deque[Request] = deque()
        self._inflight: dict[str, Request] = {}
        self._commands: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self.paused: str | None = None  # None or the mode of the pause: one of PAUSE_MODES
        self.stats = {
            "decode_steps": 0, "decode_tokens": 0, "decode_seconds": 0.0, "prefill_tokens": 0,
            "retracted_requests": 0,  # requests a retract-mode pause sent back to the queue (their KV freed)
        }  # fmt: skip
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
        lora_path: str | None = None,
        mm: object = None,
        return_routed_experts: bool = False,
    ) -> Future[GenerateAnswer]:
        """Queue a request; its future resolves to the SGLang-style answer dict."""
        self._check_size(input_ids, params.max_new_tokens)
        self._check_ready()
        req = Request(
            rid,
            list(input_ids),
            params,
            return_logprob,
            return_text_in_logprobs,
            lora_path,
            mm,
            rng=request_rng(self.random_seed, rid, params.sampling_seed),
            future=Future(),
            return_routed_experts=return_routed_experts,
        )
        with self._cond:
            if rid in self._inflight:
                raise ValueError(f"duplicate rid {rid!r}: a request with this id is in flight")
            self._inflight[rid] = req
            self._inbox.append(req)
            self._cond.notify_all()
        return req.future

    def _check_size(self, input_ids: list[int], max_new_tokens: int) -> None:
        n = len(input_ids)
        if not n:
            raise ValueError("empty prompt: input_ids/text must contain at least one token")
        # the context length is checked earlier, with SGLang's wording (LocalEngine._check_context)
        cap = self.core.max_total_tokens
        if cap is not None and n + max_new_tokens > cap:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({max_new_tokens}) exceeds --max-total-tokens={cap}"
            )

    def requests_using(self, lora_path: str) -> int:
        """Requests in flight (queued, waiting or running) that run with LoRA adapter `lora_path`."""
        with self._cond:
            return sum(r.lora_path == lora_path for r in self._inflight.values())

    def call(self, fn: Callable[[], object]) -> Future[object]:
        """Run `fn()` on the scheduler thread between forward passes; the future gets its result."""
        fut: Future[object] = Future()
        with self._cond:
            self._commands.append((fn, fut))
            self._cond.notify_all()
        return fut

    def load(self) -> dict[str, int]:
        """Queue sizes for /get_server_info and /get_load."""
        return {
            "num_waiting": len(self._inbox) + len(self.core.waiting),
            "num_running": len(self.core.running),
        }

    @property
    def waiting(self) -> list[Request]:
        """Requests not yet admitted (a snapshot)."""
        return [*self._inbox, *self.core.waiting]

    @property
    def running(self) -> list[Request]:
        """Admitted, unfinished requests (a snapshot)."""
        return list(self.core.running)

    # ---------------------------------------------------------------- on the scheduler thread
    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """Abort one request (by rid) or all; call on the scheduler thread (through `call`). Returns the count."""
        self._take_inbox()
        n = self.core.abort(rid=rid, abort_all=abort_all, message=message)
        self._deliver()
        return n

    def set_paused(self, mode: str | None) -> int:
        """Pause in one of SGLang's `PAUSE_MODES`, or resume (None); call on the scheduler thread. Until resumed,
        no forward runs and new requests wait. "abort": every request, running or queued, finishes now with
        its partial output (finish reason abort); "retract": running requests free their KV cache and go back
        to the queue, to be recomputed after the resume; "in_place": running requests stay, KV cache kept.
        Returns the requests aborted or retracted."""
        # imported here: the module's httpx (~0.2 s) is for the driver's side; the engine process never needs it
        from miles.utils.engine_control_http import PAUSE_MODES

        if mode is not None and mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} not supported; allowed: {', '.join(PAUSE_MODES)}")
        n = 0
        if mode == "abort":
            n = self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            self._take_inbox()
            n = self.core.retract_all()
            self.stats["retracted_requests"] += n
        self.paused = mode
        return n

    def record_version_change(self, old_version: str) -> None:
        """The served weights changed from `old_version`: in-flight outputs so far are attributed to it."""
        self._take_inbox()
        self.core.record_version_change(old_version)

    def _take_inbox(self) -> None:
        with self._cond:
            while self._inbox:
                self.core.add(self._inbox.popleft())

    def _has_work(self) -> bool:
        if self._commands:
            return True
        if self.paused:
            return False
        return bool(self._inbox) or self.core.has_work()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._has_work():
                    self._cond.wait(timeout=0.5)
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            self._take_inbox()
            for fn, fut in commands:
                self._run_command(fn, fut)
            self._deliver()
            if self.paused:
                continue
            if self.core.waiting and not self._ready():
                continue
            batch = self.core.schedule()
            self._deliver()  # requests with max_new_tokens == 0
            if batch is not None:
                self._step(batch)
                self._deliver()
        self.abort(abort_all=True, message="server shutting down")
        for _fn, fut in self._commands:
            fut.set_exception(RuntimeError("server shutting down"))

    def _ready(self) -> bool:
        """Check weights and KV cache before admitting; when not ready, waiting requests fail with the reason."""
        try:
            self._check_ready()
            return True
        except EngineNotReady as e:
            failed = list(self.core.waiting)
            self.core.waiting.clear()
            for req in failed:
                self._fail(req, e)
            return False

    @staticmethod
    def _run_command(fn: Callable[[], object], fut: Future[object]) -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            fut.set_exception(deliverable(e))

    def _step(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        rows = batch.sample_rows
        try:
            logits = self.runner.forward(batch)
            tokens, logprobs = sample_batch(logits, [r.req.params for r in rows], [r.req.rng for r in rows])
        except Exception as e:  # noqa: BLE001 - a model failure must fail the batch, not hang it
            logger.exception("forward pass failed; failing the %d requests of the batch", len(batch.rows))
            for req in self.core.fail(batch):
                self._fail(req, e)
            return
        self.core.postprocess(batch, tokens, logprobs)
        decode_rows = batch.num_decode_rows
        self.stats["prefill_tokens"] += batch.num_prefill_tokens
        if decode_rows:
            self.stats["decode_steps"] += 1
            self.stats["decode_tokens"] += decode_rows
            self.stats["decode_seconds"] += time.perf_counter() - t0

    def _forget(self, req: Request) -> None:
        if self._inflight.get(req.rid) is req:
            del self._inflight[req.rid]

    def _fail(self, req: Request, error: BaseException) -> None:
        with self._cond:
            self._forget(req)
        if not req.future.done():
            req.future.set_exception(deliverable(error))

    def _deliver(self) -> None:
        """Answer finished requests (they leave the in-flight set first: a client's next request with the same
        rid must not see its old one)."""
        finished = self.core.pop_finished()
        if not finished:
            return
        with self._cond:
            for req in finished:
                self._forget(req)
        for req in finished:
            if not req.future.done():
                req.future.set_result(self.output.answer(req))
