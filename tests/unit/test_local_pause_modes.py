"""The embedded engine's three pause modes (SGLang 0.5.23's /pause_generation `mode`), in-process on a tiny
Qwen3, greedy: each test fails if its mode behaves like another one.

A request is paused after exactly K outputs (the pause is queued from the scheduler thread right after the step
that produced the K-th token, so it runs before the next forward), the weights are swapped for another model's
while paused, then generation continues. The references are Hugging Face forwards:
- retract: the continuation is what a fresh request of prompt + the K outputs gives under the new weights;
- in_place: the continuation is what the new weights give on top of the old weights' KV cache (HF's cache built
  by the old model, then the new weights loaded into the same module) -- and it differs from retract's;
- abort: the request returns at once with its K outputs and finish reason abort; a queued one returns too.
"""

from __future__ import annotations

import time

import pytest
import torch

from miles.engines.local.control import RefitRefused
from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.tools.tiny_model import build_word_model
from miles.utils.serialization import serialize, share_named_tensors

torch.set_num_threads(1)

PROMPT = [3, 5, 7, 9, 11]
K, N = 4, 10  # outputs before the pause, outputs in all


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    old = build_word_model(tmp_path_factory.mktemp("old"), seed=0)
    new = build_word_model(tmp_path_factory.mktemp("new"), seed=1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return old, load(old), load(new)


@pytest.fixture
def engine(models):
    eng = LocalEngine(
        LocalEngineConfig(model_path=str(models[0]), max_running_requests=1, cpu_decode_kernel=False)
    )
    eng.start()
    yield eng
    eng.stop()


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@torch.no_grad()
def _hf_old_cache_new_weights(old, new, prompt: list[int], partial: list[int], n: int) -> list[int]:
    """Greedy continuation by `new`'s weights over the KV cache `old` built for prompt + partial[:-1]."""
    import copy

    model = copy.deepcopy(old)
    cache = model(input_ids=torch.tensor([prompt + partial[:-1]]), use_cache=True).past_key_values
    model.load_state_dict(new.state_dict())
    out, last = [], partial[-1]
    for _ in range(n):
        res = model(input_ids=torch.tensor([[last]]), past_key_values=cache, use_cache=True)
        cache, last = res.past_key_values, int(res.logits[0, -1].argmax())
        out.append(last)
    return out


def _submit(engine, ids=PROMPT, rid="r", n=N):
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    _, futs, _ = engine.submit_generate({"input_ids": ids, "rid": rid, "sampling_params": sp})
    return futs[0]


def _pause_after(engine, k: int, mode: str):
    """Queue a pause in `mode` right after the step that gives the running request its k-th output; returns
    the pause's future (set once it ran)."""
    core = engine.scheduler.core
    plain = core.postprocess
    holder: dict = {}

    def hooked(batch, tokens, logprobs):
        plain(batch, tokens, logprobs)
        if "fut" not in holder and any(len(r.req.output_ids) == k for r in batch.sample_rows):
            holder["fut"] = engine.run("pause", mode=mode)

    core.postprocess = hooked
    deadline = time.monotonic() + 30
    while "fut" not in holder and time.monotonic() < deadline:
        time.sleep(0.01)
    core.postprocess = plain
    return holder["fut"]


def _refit(engine, model, version: str, flush_cache: bool = False) -> None:
    body = [serialize(share_named_tensors(list(model.state_dict().items())))]
    engine.run("begin_weight_update").result(30)
    try:
        engine.run(
            "update_weights_from_tensor",
            serialized_named_tensors=body,
            weight_version=version,
            flush_cache=flush_cache,
        ).result(30)
    finally:
        engine.run("end_weight_update").result(30)


def _paused_run(engine, models, mode: str, flush_cache: bool = False):
    """Run PROMPT to K outputs, pause in `mode`, load the other model as version v1, continue; returns
    (answer, prefill tokens fed after the continue, the request's slot, cached tokens and retractions while
    paused)."""
    _, old, new = models
    fut = _submit(engine)
    _pause_after(engine, K, mode).result(30)
    req = engine.scheduler.running[0] if engine.scheduler.running else engine.scheduler.waiting[0]
    assert req.output_ids == _hf_greedy(old, PROMPT, K)  # paused right after the K-th output
    steps = engine.scheduler.stats["decode_steps"]
    time.sleep(0.3)
    assert (
        engine.scheduler.stats["decode_steps"] == steps and len(req.output_ids) == K
    )  # nothing while paused
    assert not fut.done()
    paused = {"slot": req.slot, "num_cached": req.num_cached, "retractions": req.retractions}
    _refit(engine, new, "v1", flush_cache)
    prefill = engine.scheduler.stats["prefill_tokens"]
    engine.run("continue").result(30)
    answer = fut.result(30)
    return answer, engine.scheduler.stats["prefill_tokens"] - prefill, paused


def test_retract_recomputes_the_kv_cache_with_the_new_weights(engine, models):
    _, old, new = models
    answer, recomputed, paused = _paused_run(
        engine, models, "retract", flush_cache=True
    )  # a flush is fine here
    assert paused == {"slot": -1, "num_cached": 0, "retractions": 1}  # KV freed, back in the queue
    ids = answer["output_ids"]
    partial = _hf_greedy(old, PROMPT, K)
    assert ids[:K] == partial and len(ids) == N
    assert ids[K:] == _hf_greedy(new, PROMPT + partial, N - K)  # prefill of prompt + outputs, new weights
    assert recomputed == len(PROMPT) + K
    assert answer["meta_info"]["finish_reason"]["type"] == "length"
    assert answer["meta_info"]["weight_versions"] == [
        {"version": "default", "start": 0, "end": K},
        {"version": "v1", "start": K, "end": N},
    ]
    assert answer["meta_info"]["weight_version"] == "v1"
    assert engine.scheduler.stats["retracted_requests"] == 1


def test_in_place_keeps_the_old_kv_cache(engine, models):
    _, old, new = models
    answer, recomputed, paused = _paused_run(engine, models, "in_place")
    # still on its slot with prompt + K-1 tokens cached (the K-th is fed next), and nothing prefilled after the
    # continue: the cache was kept
    assert paused == {"slot": 0, "num_cached": len(PROMPT) + K - 1, "retractions": 0} and recomputed == 0
    ids = answer["output_ids"]
    partial = _hf_greedy(old, PROMPT, K)
    assert ids[:K] == partial
    assert ids[K:] == _hf_old_cache_new_weights(old, new, PROMPT, partial, N - K)
    # the design check: the old cache matters here, so in_place and retract cannot agree by accident
    assert ids[K:] != _hf_greedy(new, PROMPT + partial, N - K)
    assert [s["version"] for s in answer["meta_info"]["weight_versions"]] == ["default", "v1"]
    assert engine.scheduler.stats["retracted_requests"] == 0


def test_abort_returns_running_and_queued_requests_with_their_partial_output(engine, models):
    _, old, _ = models
    running = _submit(engine, rid="running")
    queued = _submit(engine, ids=[4, 6], rid="queued")  # one slot: it waits
    _pause_after(engine, K, "abort").result(30)
    a, b = running.result(5), queued.result(5)  # returned by the pause itself, no continue
    assert a["output_ids"] == _hf_greedy(old, PROMPT, K)
    assert a["meta_info"]["finish_reason"]["type"] == "abort"
    assert a["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": K}]
    assert b["output_ids"] == [] and b["meta_info"]["finish_reason"]["type"] == "abort"
    late = _submit(engine, rid="late", n=2)  # submitted while paused: held until the continue
    time.sleep(0.3)
    assert not late.done() and engine.scheduler.stats["decode_tokens"] == K - 1  # the first came from prefill
    engine.run("continue").result(30)
    assert late.result(30)["meta_info"]["finish_reason"]["type"] == "length"


def test_in_place_refit_that_flushes_is_refused_like_sglang_but_loads(engine, models):
    """SGLang fails a weight update that asks for a cache flush while requests run (an in_place pause); the
    weights and the version are in place anyway."""
    _, _, new = models
    fut = _submit(engine)
    _pause_after(engine, 2, "in_place").result(30)
    with pytest.raises(RefitRefused, match="cache was not flushed"):
        _refit(engine, new, "v1", flush_cache=True)
    assert engine.weight_version == "v1"
    assert torch.equal(engine.model.lm_head.weight, new.lm_head.weight)
    engine.run("continue").result(30)
    assert fut.result(30)["meta_info"]["weight_version"] == "v1"


def test_bad_mode_is_refused(engine):
    with pytest.raises(
        ValueError, match="pause mode 'freeze' not supported; allowed: abort, retract, in_place"
    ):
        engine.run("pause", mode="freeze").result(5)
