"""The embedded engine's pure scheduler, driven by a mock runner (no model, no thread).

The mock runner keeps each slot's fed tokens (applying the batch's KV moves like the real pool) and checks at
every row that the slot holds exactly the request's tokens so far; its "model" picks the next token as a fixed
function of the whole sequence. So a request's output is known in advance whatever the batch composition, and a
wrong slot, position, move or chunk shows up as a failed check.
"""

from __future__ import annotations

import random

import pytest
import torch

from miles.engines.local.sampling import SamplingParams, request_rng, sample_batch
from miles.engines.local.scheduler import Request, Scheduler

VOCAB = 17
EOS = 2


def next_token(seq: list[int]) -> int:
    """The mock model's greedy choice after `seq`."""
    return (sum(seq) * 7 + len(seq) * 3) % VOCAB


class MockRunner:
    def __init__(self):
        self.kv: dict[int, list[int]] = {}  # slot -> tokens whose "keys" are stored
        self.batches = []

    def forward(self, batch) -> torch.Tensor:
        for src, dst, length in batch.moves:
            self.kv[dst] = self.kv[src][:length]
        self.batches.append(batch)
        logits = []
        slots = [r.slot for r in batch.rows]
        assert slots == sorted(set(slots)) and max(slots) < batch.num_slots
        for r in batch.rows:
            seq = r.req.input_ids + r.req.output_ids
            if r.start == 0:
                self.kv[r.slot] = []
            assert self.kv[r.slot] == seq[: r.start], f"slot {r.slot} holds the wrong tokens for {r.req.rid}"
            assert r.token_ids == seq[r.start : r.start + len(r.token_ids)]
            self.kv[r.slot] = self.kv[r.slot] + r.token_ids
            assert r.sample == (len(self.kv[r.slot]) == len(seq))
            if r.sample:
                row = torch.full((VOCAB,), -5.0)
                row[next_token(seq)] = 5.0
                logits.append(row)
        return torch.stack(logits) if logits else torch.zeros(0, VOCAB)


def reference(prompt: list[int], params: SamplingParams, eos: int | None = EOS) -> list[int]:
    """What a greedy request must produce alone."""
    seq, out = list(prompt), []
    while len(out) < params.max_new_tokens:
        t = next_token(seq)
        out.append(t)
        seq.append(t)
        if (t == eos and not params.ignore_eos) or t in params.stop_token_ids:
            break
    return out


def run(sched: Scheduler, runner: MockRunner, arrivals: dict[int, list[Request]], max_steps: int = 10_000):
    """Drive schedule -> forward -> sample -> postprocess like the engine loop; returns finished by rid."""
    done: dict[str, Request] = {}
    step = 0
    while step < max_steps and (arrivals or sched.has_work()):
        for req in arrivals.pop(step, []):
            sched.add(req)
        batch = sched.schedule()
        if batch is not None:
            rows = batch.sample_rows
            logits = runner.forward(batch)
            tokens, logprobs = sample_batch(logits, [r.req.params for r in rows], [r.req.rng for r in rows])
            sched.postprocess(batch, tokens, logprobs)
        for req in sched.pop_finished():
            assert req.rid not in done
            done[req.rid] = req
        step += 1
    return done


def make_req(rid: str, prompt: list[int], **sp) -> Request:
    params = SamplingParams(**{"temperature": 0.0, **sp})
    return Request(rid, prompt, params, return_logprob=True, rng=request_rng(0, rid))


def make_sched(slots=4, capacity=64, total=None, chunk=None) -> Scheduler:
    return Scheduler(slots, capacity, {EOS}, lambda ids, skip: " ".join(map(str, ids)), total, chunk)


@pytest.mark.parametrize("slots,chunk,total", [(1, None, None), (3, None, None), (4, 5, None), (8, 3, 40)])
def test_outputs_do_not_depend_on_batching(slots, chunk, total):
    rng = random.Random(slots)
    reqs, arrivals = {}, {}
    for i in range(12):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))]
        req = make_req(f"r{i}", prompt, max_new_tokens=rng.randint(1, 12), ignore_eos=i % 3 == 0)
        reqs[req.rid] = req
        arrivals.setdefault(rng.randrange(0, 20), []).append(req)
    sched = make_sched(slots, 64, total, chunk)
    runner = MockRunner()
    done = run(sched, runner, arrivals)
    assert sorted(done) == sorted(reqs)
    for rid, req in done.items():
        assert req.output_ids == reference(req.input_ids, req.params), rid
        fr = req.finish_reason
        assert fr["type"] == ("stop" if req.output_ids[-1] == EOS and not req.params.ignore_eos else "length")
    assert not sched.running and not sched.waiting and sched._reserved == 0
    for b in runner.batches:
        assert len(b.rows) <= slots
        if chunk is not None:
            assert b.num_prefill_tokens <= chunk
        if total is not None:
            assert sum(r.req.budget for r in b.rows) <= total


def test_prefill_and_decode_share_a_batch_and_slots_stay_dense():
    sched, runner = make_sched(slots=3), MockRunner()
    a = make_req("a", [3, 4, 5], max_new_tokens=2, ignore_eos=True)
    b = make_req("b", [6, 7], max_new_tokens=6, ignore_eos=True)
    c = make_req("c", [8, 9, 10, 11], max_new_tokens=3, ignore_eos=True)
    done = run(sched, runner, {0: [a, b], 1: [c]})
    assert set(done) == {"a", "b", "c"}
    first, second, third = runner.batches[:3]
    assert [(r.req.rid, r.is_decode) for r in first.rows] == [("a", False), ("b", False)]
    # c is prefilled in the same forward as a's and b's decode step
    assert [(r.req.rid, r.is_decode) for r in second.rows] == [("a", True), ("b", True), ("c", False)]
    # a finished in the second forward: c (last slot) moved into slot 0 with its 4 cached prompt tokens
    assert third.moves == [(2, 0, 4)]
    assert [(r.req.rid, r.slot) for r in third.rows] == [("c", 0), ("b", 1)]


def test_chunked_prefill_samples_only_after_the_last_chunk():
    sched, runner = make_sched(slots=2, chunk=4), MockRunner()
    long = make_req("long", list(range(3, 13)), max_new_tokens=3, ignore_eos=True)
    done = run(sched, runner, {0: [long]})
    chunks = [(r.start, len(r.token_ids), r.sample) for b in runner.batches for r in b.rows]
    assert chunks[:3] == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert done["long"].output_ids == reference(long.input_ids, long.params)


def test_budget_admission_waits_for_room():
    # reservations: 2 + 10 = 12 tokens each; a 30-token budget holds two at a time
    sched, runner = make_sched(slots=4, total=30), MockRunner()
    reqs = [make_req(f"r{i}", [3, 4], max_new_tokens=10, ignore_eos=True) for i in range(4)]
    done = run(sched, runner, {0: reqs})
    assert len(done) == 4
    assert max(len(b.rows) for b in runner.batches) == 2
    assert len(runner.batches) == 20  # two waves of 1 prefill + 9 decode steps


def test_stop_token_ids_and_eos():
    prompt = [5, 6, 7]
    full = reference(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop_tok = full[4]
    sched, runner = make_sched(), MockRunner()
    r1 = make_req("stop", prompt, max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_tok,))
    r2 = make_req("full", prompt, max_new_tokens=12, ignore_eos=True)
    done = run(sched, runner, {0: [r1, r2]})
    assert done["stop"].output_ids == full[: full.index(stop_tok) + 1]
    assert done["stop"].finish_reason == {"type": "stop", "matched": stop_tok}
    assert done["full"].output_ids == full and done["full"].finish_reason == {"type": "length", "length": 12}


def test_stop_strings_on_decoded_text():
    prompt = [5, 6, 7]
    full = reference(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
    stop = f" {full[3]} {full[4]}"  # the detokenizer joins ids with spaces
    sched, runner = make_sched(), MockRunner()
    req = make_req("s", prompt, max_new_tokens=10, ignore_eos=True, stop=(stop,), skip_special_tokens=False)
    done = run(sched, runner, {0: [req]})
    out = done["s"]
    assert out.output_ids == full[:5] and out.finish_reason == {"type": "stop", "matched": stop}
    text = " ".join(map(str, full[:5]))
    assert out.stop_text_end == text.find(stop)


def test_zero_new_tokens_and_one_token_prompt():
    sched, runner = make_sched(), MockRunner()
    zero = make_req("zero", [3, 4], max_new_tokens=0)
    one = make_req("one", [9], max_new_tokens=3, ignore_eos=True)
    done = run(sched, runner, {0: [zero, one]})
    assert done["zero"].output_ids == [] and done["zero"].finish_reason == {"type": "length", "length": 0}
    assert done["one"].output_ids == reference([9], one.params)
    assert all(r.req is not zero for b in runner.batches for r in b.rows)


def test_abort_waiting_and_running_frees_slots_and_budget():
    sched, runner = make_sched(slots=2, total=100), MockRunner()
    reqs = [make_req(f"r{i}", [3 + i, 4], max_new_tokens=8, ignore_eos=True) for i in range(4)]
    for r in reqs:
        sched.add(r)
    for _ in range(3):  # r0, r1 running; r2, r3 waiting
        batch = sched.schedule()
        rows = batch.sample_rows
        sched.postprocess(batch, *sample_batch(runner.forward(batch), [r.req.params for r in rows],
                                               [r.req.rng for r in rows]))  # fmt: skip
    assert [r.rid for r in sched.running] == ["r0", "r1"] and [r.rid for r in sched.waiting] == ["r2", "r3"]
    assert sched.abort(rid="r0") == 1 and sched.abort(rid="r3") == 1 and sched.abort(rid="nope") == 0
    aborted = sched.pop_finished()
    assert [r.rid for r in aborted] == ["r0", "r3"]
    assert all(r.finish_reason["type"] == "abort" for r in aborted) and len(aborted[0].output_ids) == 3
    assert [(r.rid, r.slot) for r in sched.running] == [("r1", 0)] and sched._reserved == 10
    done = run(sched, runner, {})
    assert set(done) == {"r1", "r2"}
    for rid in ("r1", "r2"):
        assert done[rid].output_ids == reference(done[rid].input_ids, done[rid].params)
    assert sched.abort(abort_all=True) == 0


def test_failed_batch_drops_its_requests_only():
    sched = make_sched(slots=2, chunk=3)
    a = make_req("a", [3, 4], max_new_tokens=4, ignore_eos=True)
    b = make_req("b", list(range(3, 9)), max_new_tokens=4, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # a whole (2 tokens) + 1 token of b
    assert [(r.req.rid, len(r.token_ids)) for r in batch.rows] == [("a", 2), ("b", 1)]
    failed = sched.fail(batch)
    assert failed == [a, b] and not sched.running and sched._reserved == 0
    assert sched.pop_finished() == []


def test_sampled_tokens_follow_the_request_rng_not_the_batch():
    # temperature 1 over a flat distribution: the token is decided by the request's own uniform draws
    class Flat(MockRunner):
        def forward(self, batch):
            super().forward(batch)
            return torch.zeros(len(batch.sample_rows), VOCAB)

    def outputs(n_others):
        sched = make_sched(slots=8)
        target = Request("t", [3, 4], SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True),
                         rng=request_rng(7, "t"))  # fmt: skip
        others = [
            Request(
                f"o{i}",
                [5] * (i + 1),
                SamplingParams(temperature=1.0, max_new_tokens=3 + i, ignore_eos=True),
                rng=request_rng(7, f"o{i}"),
            )  # fmt: skip
            for i in range(n_others)
        ]
        return run(sched, Flat(), {0: others[:2], 1: [target], 2: others[2:]})["t"].output_ids

    alone = outputs(0)
    assert outputs(5) == alone and len(set(alone)) > 1
