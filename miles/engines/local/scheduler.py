"""The embedded engine's scheduler: a pure state machine (no thread, no model, no torch).

`schedule()` builds the next forward batch, `postprocess(batch, tokens, logprobs)` takes the sampled tokens back;
finished requests come out of `pop_finished()`. The engine loop (`engine_loop.py`) wires it to the model runner
and the sampler; tests drive it with a mock runner.

Policy (SGLang's continuous batching with mixed chunked prefill):
- every running request that has its prompt cached gets one decode row per batch;
- prompt tokens still to prefill (a request admitted earlier whose prompt was longer than the chunk budget, then
  waiting requests in arrival order) fill the batch up to `chunked_prefill_size` prompt tokens, so new prompts
  are prefilled together, in the same forward as the running requests' decode step;
- a waiting request is admitted when a slot is free and its reservation (prompt + max_new_tokens) fits the
  `max_total_tokens` budget. Reservations make preemption unnecessary: an admitted request always fits its slot.
A request's slot is its row in the KV pool. Running requests always occupy slots `0..n-1`: when one leaves, the
request on the last slot moves into the hole (the move is attached to the next batch for the runner to apply).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Required, TypedDict

from miles.engines.local.sampling import SamplingParams

if TYPE_CHECKING:
    from miles.engines.local.output import GenerateAnswer


class FinishReason(TypedDict, total=False):
    """SGLang's `meta_info.finish_reason`: stop (a stop token id or stop string matched), length, abort."""

    type: Required[Literal["stop", "length", "abort"]]
    matched: int | str  # stop
    length: int  # length
    message: str  # abort


@dataclass(eq=False, slots=True)
class Request:
    """One generation request and its progress."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    lora_path: str | None = None  # the LoRA adapter the request runs with (None: the base model)
    # the sampler's per-request RNG (the engine loop seeds it); the scheduler never reads it
    rng: random.Random = field(default_factory=random.Random)
    # the engine loop's handle for the answer; the scheduler never reads it
    future: Future[GenerateAnswer] = field(default_factory=Future)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1  # row of the KV pool while running
    num_cached: int = 0  # tokens (prompt, then outputs) whose keys/values are in the pool
    finish_reason: FinishReason | None = None
    stop_text_end: int | None = None  # where a matched stop string starts in the decoded text
    created: float = field(default_factory=time.monotonic)
    stop_ids: frozenset[int] = (
        frozenset()
    )  # tokens that finish it (EOS unless ignored, stop_token_ids): set on add

    @property
    def budget(self) -> int:
        """KV tokens this request may occupy."""
        return len(self.input_ids) + self.params.max_new_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.input_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[: end - n]


@dataclass(eq=False, slots=True)
class BatchRow:
    """The tokens one request feeds in one forward."""

    req: Request
    slot: int
    start: int  # position of token_ids[0]: tokens of this request already in the pool
    token_ids: list[int]
    sample: bool  # the logits after the last token pick the request's next token

    @property
    def is_decode(self) -> bool:
        return self.start >= len(self.req.input_ids)


@dataclass(eq=False)
class Batch:
    """One forward pass: rows ordered by slot, and KV moves to apply before it."""

    rows: list[BatchRow]
    moves: list[tuple[int, int, int]]  # (source slot, destination slot, tokens to copy), in order
    num_slots: int  # slots in use; every row's slot is below it
    sample_rows: list[BatchRow] = field(init=False)  # rows whose last token's logits pick a token, in order
    num_decode_rows: int = field(init=False)
    num_prefill_tokens: int = field(init=False)  # prompt tokens fed (decode rows excluded)

    def __post_init__(self) -> None:
        self.sample_rows = [r for r in self.rows if r.sample]
        prefill = [len(r.token_ids) for r in self.rows if not r.is_decode]
        self.num_decode_rows = len(self.rows) - len(prefill)
        self.num_prefill_tokens = sum(prefill)


class Scheduler:
    """Waiting queue, running set (by slot), budgets, stop conditions."""

    def __init__(
        self,
        num_slots: int,
        slot_capacity: int,
        eos_ids: Iterable[int],
        detokenize: Callable[[list[int], bool], str],
        max_total_tokens: int | None = None,
        chunked_prefill_size: int | None = None,
    ):
        if num_slots < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {num_slots}")
        if max_total_tokens is not None and max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens must be >= 1, got {max_total_tokens}")
        if chunked_prefill_size is not None and chunked_prefill_size < 1:
            raise ValueError(f"--chunked-prefill-size must be >= 1 or -1 (off), got {chunked_prefill_size}")
        self.num_slots = num_slots
        self.slot_capacity = slot_capacity
        self.eos_ids = set(eos_ids)
        self.detokenize = detokenize
        self.max_total_tokens = max_total_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i].slot == i
        self._reserved = 0  # sum of running budgets
        self._moves: list[tuple[int, int, int]] = []
        self._finished: list[Request] = []

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Queue a request (its size was checked against the budgets by the caller)."""
        assert req.budget <= self.slot_capacity + 1, (req.budget, self.slot_capacity)
        eos = () if req.params.ignore_eos else self.eos_ids
        req.stop_ids = frozenset((*eos, *req.params.stop_token_ids))
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Whether `schedule()` would return a batch (or finish a request)."""
        return bool(self.running) or (bool(self.waiting) and self._can_admit(self.waiting[0]))

    def pop_finished(self) -> list[Request]:
        """Requests finished since the last call (stop, length, abort), each once."""
        out, self._finished = self._finished, []
        return out

    def _can_admit(self, req: Request) -> bool:
        if len(self.running) >= self.num_slots:
            return False
        return self.max_total_tokens is None or self._reserved + req.budget <= self.max_total_tokens

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Batch | None:
        """The next batch: a decode row per running request, then prompt chunks up to the prefill budget."""
        budget = self.chunked_prefill_size or float("inf")
        rows: list[BatchRow] = []
        for req in self.running:
            start = req.num_cached
            if start >= len(req.input_ids):  # decode: feed the last sampled token
                rows.append(BatchRow(req, req.slot, start, [req.output_ids[-1]], True))
            elif budget > 0:
                budget -= self._prefill_row(req, budget, rows)
        while self.waiting and budget > 0 and self._can_admit(self.waiting[0]):
            req = self.waiting[0]
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            self.waiting.popleft()
            req.slot = len(self.running)
            self.running.append(req)
            self._reserved += req.budget
            budget -= self._prefill_row(req, budget, rows)
        if not rows:
            return None
        moves, self._moves = self._moves, []
        return Batch(rows, moves, len(self.running))

    @staticmethod
    def _prefill_row(req: Request, budget: float, rows: list[BatchRow]) -> int:
        start = req.num_cached
        end = int(min(len(req.input_ids), start + budget))  # budget may be inf (no chunking)
        rows.append(BatchRow(req, req.slot, start, req.input_ids[start:end], end == len(req.input_ids)))
        return end - start

    def postprocess(self, batch: Batch, tokens: list[int], logprobs: list[float]) -> None:
        """Account the fed tokens, append the sampled ones (one per sample row, in row order), finish requests."""
        for row in batch.rows:
            row.req.num_cached = row.start + len(row.token_ids)
        sample_rows = batch.sample_rows
        assert len(tokens) == len(logprobs) == len(sample_rows), (len(tokens), len(sample_rows))
        done: list[tuple[Request, FinishReason]] = []
        for row, token, logprob in zip(sample_rows, tokens, logprobs):
            req = row.req
            req.output_ids.append(token)
            req.logprobs.append(logprob)
            if token in req.stop_ids:
                done.append((req, {"type": "stop", "matched": token}))
            elif req.params.stop or len(req.output_ids) >= req.params.max_new_tokens:
                reason = self._check_stop(req)
                if reason is not None:
                    done.append((req, reason))
        for req, reason in done:
            self._finish(req, reason)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """Finish one request (by rid) or all, waiting or running, with finish reason abort; returns the count."""
        victims = [r for r in (*self.waiting, *self.running) if abort_all or r.rid == rid]
        for r in victims:
            self._finish(r, {"type": "abort", "message": message})
        return len(victims)

    def fail(self, batch: Batch) -> list[Request]:
        """Drop every request of a batch whose forward failed; returns them (their futures get the error)."""
        reqs = [row.req for row in batch.rows if row.req.finish_reason is None]
        for req in reqs:
            self._remove(req)
            req.finish_reason = {"type": "abort", "message": "forward pass failed"}
        return reqs

    # ------------------------------------------------------------------ finishing
    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._remove(req)
        self._finished.append(req)

    def _remove(self, req: Request) -> None:
        if req.slot < 0:
            self.waiting.remove(req)
            return
        i, last = req.slot, self.running[-1]
        if last is not req:  # keep slots dense: the last request moves into the hole
            self._moves.append((last.slot, i, last.num_cached))
            self.running[i] = last
            last.slot = i
        self.running.pop()
        self._reserved -= req.budget
        req.slot = -1
        if not self.running:  # nobody left to move (the pool may even be released now)
            self._moves = []

    def _check_stop(self, req: Request) -> FinishReason | None:
        """Stop strings, then the length limit (stop tokens were checked by the caller)."""
        p = req.params
        if p.stop and self._stop_in_tail(req.output_ids, p):
            text = self.detokenize(req.output_ids, p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                start, s = min(hits)
                req.stop_text_end = start
                return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    def _stop_in_tail(self, ids: list[int], p: SamplingParams) -> bool:
        """Whether a stop string may have just completed: checked on the last few tokens only, so a long
        generation is not re-decoded whole at every step. A string that was not there before this token ends
        in it and spans at most 4 tokens per character (byte-level pieces), plus one partial character. With
        skip_special_tokens, tokens may decode to nothing, so the whole output is checked."""
        if p.skip_special_tokens:
            return True
        window = 4 * max(len(s) for s in p.stop) + 4
        tail = self.detokenize(ids[-window:], False)
        return any(s in tail for s in p.stop)
