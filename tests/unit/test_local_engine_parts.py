"""Pieces of the embedded engine in-process (no HTTP): runners vs HF forward, sampler, weights, scheduler."""

from __future__ import annotations

import os

import pytest
import torch

from miles.engines.local.engine import EngineConfig, LocalEngine
from miles.engines.local.model_runner import CachedRunner, NoCacheRunner, make_runner
from miles.engines.local.sampling import SamplingParams, filter_probs, sample_token
from miles.engines.local.testing import build_tiny_model
from miles.engines.local.weights import EngineNotReady, WeightStore

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


def _tiny(model_type: str, tie: bool = False):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    if model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    elif model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=128))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize(
    "model_type,tie", [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", False)]
)
def test_cached_runner_matches_full_forward(model_type, tie):
    model = _tiny(model_type, tie)
    runner = make_runner(model)
    assert isinstance(runner, CachedRunner)
    _check_runner_against_forward(model, runner)


def test_fallback_runner_for_other_architectures():
    model = _tiny("gpt2")
    runner = make_runner(model)
    assert isinstance(runner, NoCacheRunner)
    _check_runner_against_forward(model, runner)


def _check_runner_against_forward(model, runner):
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    caches = [runner.new_cache() for _ in prompts]
    got = [[runner.prefill(p, c)] for p, c in zip(prompts, caches)]
    seqs = [list(p) for p in prompts]
    for step in range(6):
        active = [
            i for i in range(len(prompts)) if step < 2 + 2 * i
        ]  # rows leave the batch at different steps
        nxt = [int(got[i][-1].argmax()) for i in active]
        for i, t in zip(active, nxt):
            seqs[i].append(t)
        logits = runner.decode(nxt, [caches[i] for i in active])
        for row, i in enumerate(active):
            got[i].append(logits[row])
    for p, s, g in zip(prompts, seqs, got):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([s])).logits[0, len(p) - 1 :].float()
        assert len(g) == len(s) - len(p) + 1
        torch.testing.assert_close(torch.stack(g), ref, atol=2e-5, rtol=1e-5)


def _filter_loop(probs: list[float], top_k: int, top_p: float) -> list[float]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if top_k != -1 and rank >= top_k:
            break
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(
    "top_k,top_p", [(-1, 1.0), (1, 1.0), (3, 1.0), (-1, 0.5), (-1, 0.9), (4, 0.7), (-1, 1e-6)]
)
def test_filter_probs_matches_loop(top_k, top_p):
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(12, dtype=torch.float64), 0)
    got = filter_probs(probs, top_k, top_p)
    ref = torch.tensor(_filter_loop(probs.tolist(), top_k, top_p), dtype=torch.float64)
    torch.testing.assert_close(got, ref)


def test_sample_token_logprob_is_prefilter_and_greedy_uses_t1():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    gen = torch.Generator().manual_seed(0)
    tok, lp = sample_token(logits, SamplingParams(temperature=0.0), gen)
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(logits, 0)[0]))
    tok, lp = sample_token(logits, SamplingParams(temperature=0.5, top_k=1), gen)
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(logits / 0.5, 0)[0]), abs=1e-6)
    counts = torch.zeros(4)
    for _ in range(400):
        counts[sample_token(logits, SamplingParams(temperature=1.0, top_p=0.7), gen)[0]] += 1
    assert counts[2:].sum() == 0 and counts[1] > 0  # p = .61, .22, .14, .03: top-p 0.7 keeps tokens 0, 1


def test_sampling_params_validation():
    sp = SamplingParams.from_dict({"temperature": 0.5, "stop": "x", "max_new_tokens": 4, "n": 1})
    assert sp.stop == ("x",) and sp.logprob_temperature == 0.5
    with pytest.raises(ValueError, match="top_p") as e:
        SamplingParams.from_dict({"top_p": 0.0, "top_k": 0, "repetition_penalty": 1.2})
    assert "top_k" in str(e.value) and "repetition_penalty" in str(e.value)


def test_weight_store_release_resume_and_aliases():
    model = _tiny("qwen3", tie=True)
    store = WeightStore(model)
    assert store.resolve("lm_head.weight") == store.resolve("model.embed_tokens.weight")
    full = store.allocated_bytes()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    store.release()
    assert store.allocated_bytes() == 0
    with pytest.raises(EngineNotReady, match="released"):
        store.check_ready()
    store.resume()
    assert store.allocated_bytes() == full and len(store.pending) == len(original)
    store.load([(n, t) for n, t in original.items() if "layers.1" not in n])
    with pytest.raises(EngineNotReady, match="layers.1"):
        store.check_ready()
    store.load([("lm_head.weight", original["model.embed_tokens.weight"])])  # alias of the tied embedding
    store.load([(n, t) for n, t in original.items() if "layers.1" in n])
    store.check_ready()
    for n, p in model.named_parameters():
        assert torch.equal(p, original[n])


@pytest.fixture(scope="module")
def local_engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    eng = LocalEngine(EngineConfig(model_path=str(path), max_running_requests=2, max_total_tokens=40))
    eng.start()
    yield eng
    eng.stop()


def _run(engine, body, timeout=30):
    _, futs, batch = engine.submit_generate(body)
    outs = [f.result(timeout) for f in futs]
    return outs if batch else outs[0]


def test_eos_stops_unless_ignored(local_engine):
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    ref = _run(local_engine, {"input_ids": [3, 4, 5], "sampling_params": sp})
    assert len(ref["output_ids"]) == 8
    eos = ref["output_ids"][1]
    first = ref["output_ids"].index(eos)
    old = local_engine.scheduler.eos_ids
    local_engine.scheduler.eos_ids = {eos}
    try:
        out = _run(
            local_engine, {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        )
        assert out["output_ids"] == ref["output_ids"][: first + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert (
            _run(local_engine, {"input_ids": [3, 4, 5], "sampling_params": sp})["output_ids"]
            == ref["output_ids"]
        )
    finally:
        local_engine.scheduler.eos_ids = old


def test_admission_budgets(local_engine):
    with pytest.raises(ValueError, match="max-total-tokens"):
        local_engine.submit_generate({"input_ids": [3] * 30, "sampling_params": {"max_new_tokens": 20}})
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    before = dict(local_engine.scheduler.stats)
    outs = _run(local_engine, {"input_ids": [[3, 4], [5, 6], [7, 8], [9, 10]], "sampling_params": sp})
    assert all(len(o["output_ids"]) == 10 for o in outs)
    steps = local_engine.scheduler.stats["decode_steps"] - before["decode_steps"]
    # budget 40 tokens / 12 per request -> at most 2 run together (also --max-running-requests 2): 2 waves of 9
    assert steps == 18


def test_rejects_ambiguous_or_empty_input(local_engine):
    with pytest.raises(ValueError, match="exactly one"):
        local_engine.submit_generate({"input_ids": [1], "text": "a"})
    with pytest.raises(ValueError, match="empty prompt"):
        local_engine.submit_generate({"input_ids": []})


def test_generate_field_checks_and_text_in_logprobs(local_engine, tmp_path):
    body = {
        "input_ids": [3, 4],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    }
    with pytest.raises(ValueError, match="stream=True is not supported"):
        local_engine.submit_generate({**body, "stream": True})
    with pytest.raises(ValueError, match="unknown field 'bogus'"):
        local_engine.submit_generate({**body, "bogus": 1})
    extra = {"stream": False, "logprob_start_len": -1, "log_metrics": True, "return_logprob": True}
    out = _run(local_engine, {**body, **extra, "return_text_in_logprobs": True})
    texts = [x for _, _, x in out["meta_info"]["output_token_logprobs"]]
    assert texts == [local_engine.tokenizer.decode([t]) for t in out["output_ids"]]


def test_unflatten_bucket_mixed_dtypes():
    from miles.engines.local.weights import unflatten_bucket

    a = torch.randn(2, 3)
    b = torch.randn(4).to(torch.bfloat16)
    raw = torch.cat([a.flatten().view(torch.uint8), b.view(torch.uint8)])
    meta = [
        {"name": "a", "shape": [2, 3], "dtype": torch.float32, "start_idx": 0, "end_idx": 24, "numel": 6},
        {"name": "b", "shape": [4], "dtype": torch.bfloat16, "start_idx": 24, "end_idx": 32, "numel": 4},
    ]
    (na, ta), (nb, tb) = unflatten_bucket({"flattened_tensor": raw, "metadata": meta})
    assert (na, nb) == ("a", "b") and torch.equal(ta, a) and torch.equal(tb, b)
    with pytest.raises(ValueError, match="flattened_tensor and metadata"):
        unflatten_bucket([("a", a)])


def test_text_prompt_equals_token_prompt(local_engine):
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    ids = local_engine.tokenizer.encode("the cat sat on")
    by_text = _run(local_engine, {"text": "the cat sat on", "sampling_params": sp})
    by_ids = _run(local_engine, {"input_ids": ids, "sampling_params": sp})
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["meta_info"]["prompt_tokens"] == len(ids)
    batch = _run(local_engine, {"text": ["the cat", "a dog"], "sampling_params": sp})
    assert len(batch) == 2 and all(len(o["output_ids"]) == 4 for o in batch)


def test_bfloat16_engine_runs_in_its_dtype(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    eng = LocalEngine(EngineConfig(model_path=str(path), dtype="bfloat16"))
    assert eng.model.model.embed_tokens.weight.dtype == torch.bfloat16
    eng.start()
    try:
        sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
        out = _run(eng, {"input_ids": [[3, 4, 5], [6]], "sampling_params": sp, "return_logprob": True})
        assert all(len(o["meta_info"]["output_token_logprobs"]) == 5 for o in out)
        assert all(lp <= 0 for o in out for lp, _, _ in o["meta_info"]["output_token_logprobs"])
    finally:
        eng.stop()
    with pytest.raises(ValueError, match="--dtype 'int8'"):
        LocalEngine(EngineConfig(model_path=str(path), dtype="int8"))


def test_failed_decode_step_fails_only_the_batch(local_engine, monkeypatch):
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(local_engine.runner, "decode", broken)
    _, futs, _ = local_engine.submit_generate({"input_ids": [3, 4], "sampling_params": sp})
    with pytest.raises(RuntimeError, match="boom"):
        futs[0].result(30)
    monkeypatch.undo()
    assert len(_run(local_engine, {"input_ids": [3, 4], "sampling_params": sp})["output_ids"]) == 4


def test_batch_is_all_or_nothing(local_engine):
    long_sp = {"max_new_tokens": 20, "ignore_eos": True}
    with pytest.raises(ValueError, match="unique"):
        local_engine.submit_generate({"input_ids": [[3], [4]], "rid": ["x", "x"]})
    _, busy, _ = local_engine.submit_generate(
        {"input_ids": [3, 4], "rid": "busy", "sampling_params": long_sp}
    )
    with pytest.raises(ValueError, match="duplicate rid 'busy'"):
        local_engine.submit_generate(
            {"input_ids": [[5], [6]], "rid": ["first", "busy"], "sampling_params": long_sp}
        )
    local_engine.scheduler.call(lambda: None).result(30)  # barrier: queued commands (the withdrawal) have run
    sched = local_engine.scheduler
    assert "first" not in [r.rid for r in (*sched.waiting, *sched.running) if r.finish_reason is None]
    assert busy[0].result(30)["meta_info"]["finish_reason"]["type"] == "length"
