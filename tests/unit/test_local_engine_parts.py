"""Pieces of the embedded engine in-process (no HTTP): runners vs HF forward, sampler, weights, scheduler."""

from __future__ import annotations

import pytest
import torch

from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.engines.local.model_runner import (
    NoCacheRunner,
    PoolRunner,
    _Norm,
    _pad_buckets,
    _rms_normalize,
    make_runner,
)
from miles.engines.local.sampling import (
    SamplingParams,
    filter_probs,
    request_rng,
    sample_batch,
    sample_token,
)
from miles.engines.local.scheduler import Request, Scheduler
from miles.engines.local.weights import EngineNotReady, WeightStore
from miles.tools.tiny_model import build_word_model

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
    elif model_type == "llama_dynamic_rope":  # frequencies depend on the length: RoPE computed per step
        rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        model = LlamaForCausalLM(LlamaConfig(rope_parameters=rope, **common))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=128))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def drive(runner, arrivals: dict[int, list[Request]], slots: int, chunk: int | None = None, capacity=64):
    """Run requests through the real scheduler and `runner` like the engine loop; returns (finished requests by
    rid, the logits each request was sampled from, the batches)."""
    sched = Scheduler(slots, capacity, set(), lambda ids, skip: "", None, chunk)
    seen: dict[str, list[torch.Tensor]] = {}
    done, batches, step = {}, [], 0
    while arrivals or sched.has_work():
        for req in arrivals.pop(step, []):
            sched.add(req)
        step += 1
        batch = sched.schedule()
        if batch is None:
            continue
        batches.append(batch)
        rows = batch.sample_rows
        logits = runner.forward(batch)
        for row, lg in zip(rows, logits):
            seen.setdefault(row.req.rid, []).append(lg)
        sched.postprocess(
            batch, *sample_batch(logits, [r.req.params for r in rows], [r.req.rng for r in rows])
        )
        done.update((r.rid, r) for r in sched.pop_finished())
    return done, seen, batches


def _req(rid, prompt, n, temperature=0.0, **sp):
    params = SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True, **sp)
    return Request(rid, list(prompt), params, return_logprob=True, rng=request_rng(0, rid))


def _check_against_forward(model, done, seen):
    for rid, req in done.items():
        seq = req.input_ids + req.output_ids
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([seq])).logits[0, len(req.input_ids) - 1 : -1].float()
        torch.testing.assert_close(torch.stack(seen[rid]), ref, atol=2e-5, rtol=1e-5, msg=rid)


def _staggered_requests():
    prompts = [
        [1, 2, 3, 4, 5],
        [7, 8],
        [9, 10, 11, 12, 13, 14, 15, 16, 17],
        [20],
        [30, 31, 32],
        [40, 41, 42, 43],
    ]
    lens = [6, 2, 5, 4, 7, 3]
    reqs = [_req(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lens))]
    return {0: reqs[:3], 2: reqs[3:5], 3: reqs[5:]}


@pytest.mark.parametrize("shape", [(64, 512), (5, 32), (7, 12, 64), (1, 3, 8)])
def test_rms_norm_is_bitwise_hf_rmsnorm(shape):
    """The runner's RMSNorm (four ops on CPU float32) gives bitwise what HF's module gives, with and without the
    weight (Qwen3's q/k norms apply theirs apart); bfloat16 takes F.rms_norm, as close to HF as it was."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(sum(shape))
    hf = Qwen3RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1], generator=gen))
    norm = _Norm(hf.weight, hf.variance_epsilon)
    for scale in (1.0, 1e-3, 30.0):
        x = torch.randn(shape, generator=gen) * scale
        with torch.inference_mode():
            assert torch.equal(norm(x), hf(x))
            unit = Qwen3RMSNorm(shape[-1], eps=1e-6)
            assert torch.equal(_rms_normalize(x, 1e-6), unit(x))
    xb = torch.randn(shape, generator=gen).bfloat16()
    with torch.no_grad():
        hb = hf.bfloat16()
        torch.testing.assert_close(_Norm(hb.weight, hb.variance_epsilon)(xb), hb(xb), atol=0.02, rtol=0.02)


@pytest.mark.parametrize(
    "model_type,tie",
    [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", False), ("llama_dynamic_rope", False)],
)
def test_pool_runner_matches_full_forward(model_type, tie):
    """Batched prefill, mixed prefill + decode, chunked prompts, rows leaving (slot moves): logits equal HF's."""
    model = _tiny(model_type, tie)
    runner = make_runner(model, num_slots=3, capacity=32)
    assert isinstance(runner, PoolRunner)
    assert (runner._rope_table is None) == (model_type == "llama_dynamic_rope")
    done, seen, batches = drive(runner, _staggered_requests(), slots=3, chunk=6)
    assert len(done) == 6
    assert any(b.moves for b in batches) and any(b.num_decode_rows and b.num_prefill_tokens for b in batches)
    _check_against_forward(model, done, seen)


def test_pool_runner_decode_rows_on_scattered_slots():
    """Decode rows around a slot still prefilling (not contiguous) read the pool through an index."""
    model = _tiny("qwen3")
    runner = make_runner(model, num_slots=4, capacity=40)
    # a, b, e decode from step 2; c's 24-token prompt is prefilled 2, 6, 6, ... tokens per step. b leaves after
    # step 2, c (last slot) moves into its slot 1, so step 3 decodes a (slot 0) and e (slot 2) around c.
    a, b, e, c = (
        _req("a", [3, 4], 8),
        _req("b", [5], 2),
        _req("e", [6], 6),
        _req("c", list(range(1, 25)), 3),
    )
    done, seen, batches = drive(runner, {0: [a, b, e, c]}, slots=4, chunk=6)
    scattered = [bt for bt in batches if [(r.slot, r.is_decode) for r in bt.rows] == [(0, 1), (1, 0), (2, 1)]]
    assert scattered, [[(r.req.rid, r.slot, r.is_decode) for r in bt.rows] for bt in batches]
    _check_against_forward(model, done, seen)


def test_pool_runner_prompts_of_very_different_lengths_are_bucketed():
    """One long prompt among short ones: padding is bounded by splitting the prompts into length buckets."""
    model = _tiny("qwen3")
    runner = make_runner(model, num_slots=6, capacity=64)
    lens = [40, 2, 3, 2, 5, 3]
    reqs = [_req(f"p{i}", [(5 * i + j) % 61 for j in range(n)], 3) for i, n in enumerate(lens)]
    done, seen, batches = drive(runner, {0: reqs}, slots=6)
    buckets = _pad_buckets(batches[0].rows)
    assert [[len(r.token_ids) for r in b] for b in buckets] == [[2, 2, 3, 3, 5], [40]]
    _check_against_forward(model, done, seen)


@pytest.mark.parametrize("chunk", [None, 8])
def test_identical_prompts_are_fed_once_and_copied(chunk):
    """GRPO's n samples of a prompt: the first feeds the prompt, the others get a copy of its keys/values and its
    logits (whole prompts, or identical first chunks when prompts are chunked); every sample still draws its own
    tokens, and all logits equal HF's forward of each sequence."""
    model = _tiny("qwen3")
    runner = make_runner(model, num_slots=10, capacity=40)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [3, 4, 5, 6, 7, 8, 12]]  # the third starts like the first
    reqs = [_req(f"p{i}s{j}", p, 5, temperature=1.0) for i, p in enumerate(prompts) for j in range(3)]
    late = _req("late", prompts[0], 4, temperature=1.0)  # arrives once the others decode: fed on its own
    fed = []
    original = runner._pack

    def spy(batch):
        packed = original(batch)
        fed.append((packed.ids.numel(), packed.copies))
        return packed

    runner._pack = spy
    done, seen, batches = drive(runner, {0: reqs, 2: [late]}, slots=10, chunk=chunk)
    assert len(done) == 10
    prompt_tokens = [sum(len(r.token_ids) for r in b.rows if not r.is_decode) for b in batches]
    packed_tokens = [n - b.num_decode_rows for (n, _), b in zip(fed, batches)]
    copied = [c for _, cs in fed for c in cs]
    if chunk is None:  # one batch: 3 distinct prompts of 6 + 3 + 7 tokens fed, the 6 other samples copied
        assert packed_tokens[0] == 16 and prompt_tokens[0] == 48
        assert sorted(n for _, _, n in fed[0][1]) == [3, 3, 6, 6, 7, 7]
    else:  # 8 prompt tokens per forward: identical first chunks still go once
        assert copied and sum(packed_tokens) < sum(prompt_tokens)
    late_batch = next(i for i, b in enumerate(batches) if any(r.req.rid == "late" for r in b.rows))
    assert not fed[late_batch][1]  # its twins are decoding: nothing to copy from in this forward
    assert len({tuple(r.output_ids) for r in done.values()}) > 3  # samples of one prompt differ
    _check_against_forward(model, done, seen)


def test_fallback_runner_for_other_architectures():
    model = _tiny("gpt2")
    runner = make_runner(model, num_slots=3, capacity=32)
    assert isinstance(runner, NoCacheRunner)
    done, seen, _ = drive(runner, _staggered_requests(), slots=3, chunk=6)
    _check_against_forward(model, done, seen)


def test_same_tokens_alone_and_in_a_batch_of_many():
    """Per-request seeding: a sampled request gets the same tokens (and log-probs) alone and among 15 others
    arriving before and after it, whatever the slots and chunking."""
    model = _tiny("qwen3")
    prompt = [5, 9, 14, 2, 33]

    def target():
        return _req("target", prompt, 12, temperature=1.0, top_p=0.9)

    alone, _, _ = drive(make_runner(model, 1, 32), {0: [target()]}, slots=1)
    others = [_req(f"o{i}", [(7 * i + j) % 61 for j in range(1 + i % 6)], 3 + i % 9, temperature=1.0)
              for i in range(15)]  # fmt: skip
    crowd, _, batches = drive(
        make_runner(model, 8, 32), {0: others[:6], 2: [target()], 3: others[6:]}, slots=8, chunk=7
    )
    assert max(len(b.rows) for b in batches) == 8
    assert crowd["target"].output_ids == alone["target"].output_ids
    torch.testing.assert_close(
        torch.tensor(crowd["target"].logprobs), torch.tensor(alone["target"].logprobs), atol=1e-6, rtol=0
    )


def test_kv_pool_release_frees_and_resume_reallocates():
    model = _tiny("qwen3")
    runner = make_runner(model, num_slots=4, capacity=16)
    full = runner.pool.nbytes
    assert runner.kv_allocated_bytes() == full == 2 * 2 * 4 * 2 * 16 * 8 * 4
    done, _, _ = drive(runner, {0: [_req("x", [3, 4, 5], 4)]}, slots=4, capacity=16)
    runner.release_kv()
    assert runner.kv_allocated_bytes() == 0 and runner.pool.k == []
    with pytest.raises(RuntimeError, match="released"):
        drive(runner, {0: [_req("y", [3, 4, 5], 4)]}, slots=4, capacity=16)
    runner.resume_kv()
    assert runner.kv_allocated_bytes() == full and runner.pool.initialized == 0
    runner.pool.data.fill_(
        float("nan")
    )  # garbage in fresh memory: masked positions must be zeroed before use
    reqs = [_req("x", [3, 4, 5], 4), _req("z", [7], 9)]
    again, seen, _ = drive(runner, {0: reqs}, slots=4, capacity=16)
    # zeroed up to the longest length (9), rounded up to the zeroing step, at most the capacity
    assert again["x"].output_ids == done["x"].output_ids and runner.pool.initialized == 16
    _check_against_forward(model, again, seen)


def test_fused_weight_views_follow_a_swapped_parameter_without_notice():
    """`FusedLinear.weight()` keeps its views between calls; a parameter given other data (no store told it, so
    nothing dropped them) is noticed by where the data lies: the next call multiplies by the new weights."""
    from torch import nn

    from miles.engines.local.fused import FusedLinear

    gen = torch.Generator().manual_seed(3)
    lins = [nn.Linear(8, n, bias=True) for n in (8, 4)]
    fused = FusedLinear(lins)
    x = torch.randn(3, 8, generator=gen)
    w1, _ = fused.weight()
    assert fused.weight()[0] is w1  # kept
    with torch.no_grad():
        lins[1].weight.data = torch.randn(4, 8, generator=gen)  # own storage: the blocks are laid out again
        lins[0].bias.data = torch.randn(8, generator=gen)
    w2, _ = fused.weight()
    assert w2 is not w1 and w2.data_ptr() == lins[0].weight.data_ptr()
    assert torch.equal(fused(x), torch.cat([lin(x) for lin in lins], -1))
    fused.forget_views()
    assert fused.weight()[0] is not w2 and torch.equal(fused(x), torch.cat([lin(x) for lin in lins], -1))


def test_fused_projections_follow_refits_and_weight_release():
    """q/k/v (with biases here) and gate/up run as one matmul each, over one [in, out] buffer whose blocks are
    the parameters: a refit (a copy into the parameters) reaches it, releasing the weights leaves no tensor
    holding its memory, and after resume + reload it is laid out again."""
    import gc

    model = _tiny("qwen2")
    runner = make_runner(model, num_slots=2, capacity=32)
    attn = model.model.layers[1].self_attn
    w, b = runner.layers[1].qkv.weight()
    assert w.data_ptr() == attn.q_proj.weight.data_ptr() and b.data_ptr() == attn.q_proj.bias.data_ptr()
    assert torch.equal(w.t(), torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    x = torch.randn(5, w.shape[0])
    assert torch.equal(runner.layers[1].qkv(x)[:, : attn.q_proj.weight.shape[0]], attn.q_proj(x))  # as HF
    del w, b
    store = WeightStore(model)
    store.on_change(runner.forget_views)  # as LocalEngine wires them: the kept weight views go at a release
    gen = torch.Generator().manual_seed(5)
    fresh = {n: torch.randn(p.shape, generator=gen) * 0.3 for n, p in model.named_parameters()}
    store.load(fresh.items())
    done, seen, _ = drive(runner, {0: [_req("a", [3, 4, 5], 5), _req("b", [9], 4)]}, slots=2, capacity=32)
    _check_against_forward(model, done, seen)
    fused_storage = attn.q_proj.weight.untyped_storage().data_ptr()

    def holders() -> int:
        gc.collect()
        tensors = [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)]
        return sum(t.untyped_storage().data_ptr() == fused_storage for t in tensors if t.numel())

    assert holders() >= 3  # q, k, v
    store.release()
    assert holders() == 0
    store.resume()
    store.load(fresh.items())
    again, seen, _ = drive(runner, {0: [_req("a", [3, 4, 5], 5), _req("b", [9], 4)]}, slots=2, capacity=32)
    assert {r: q.output_ids for r, q in again.items()} == {r: q.output_ids for r, q in done.items()}
    assert runner.layers[1].qkv.weight()[0].data_ptr() == attn.q_proj.weight.data_ptr()
    assert runner.layers[0].up.weight()[0].data_ptr() == model.model.layers[0].mlp.up_proj.weight.data_ptr()
    _check_against_forward(model, again, seen)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_packed_projections_match_forward_and_follow_every_weight_change(model_type, monkeypatch):
    """CPU float32 with a WeightStore: the projections run on oneDNN-packed copies (forced here below the size
    and row thresholds); logits stay within the HF forward's tolerance, and a load, a release, a resume + load
    each reach the copies (dropped at the change, packed again at the next forward)."""
    from miles.engines.local import fused

    monkeypatch.setattr(fused, "PACKED_MIN_ROWS", 1)
    model = _tiny(model_type)  # qwen2: q/k/v with biases
    store = WeightStore(model)
    runner = PoolRunner(model, num_slots=3, capacity=32, weights=store, pack_min_elements=0)
    projections = 5 * len(runner.layers)  # qkv, o, gate, up, down
    assert runner.prepacked_projections == 0  # packed lazily, at the first forward
    done, seen, _ = drive(runner, _staggered_requests(), slots=3, chunk=6)
    assert runner.prepacked_projections == projections
    assert runner.layers[0].gate.packed is not None and runner.layers[0].gate.packed.is_mkldnn
    _check_against_forward(model, done, seen)

    gen = torch.Generator().manual_seed(7)
    fresh = {n: torch.randn(p.shape, generator=gen) * 0.3 for n, p in model.named_parameters()}
    store.load(fresh.items())
    assert runner.prepacked_projections == 0
    again, seen, _ = drive(runner, _staggered_requests(), slots=3, chunk=6)
    assert runner.prepacked_projections == projections
    _check_against_forward(model, again, seen)  # the new weights, not the packed old ones
    assert {r: q.output_ids for r, q in again.items()} != {r: q.output_ids for r, q in done.items()}

    store.release()  # the copies go with the weights
    assert runner.prepacked_projections == 0 and all(p.packed is None for p in runner._prepack)
    store.resume()
    store.load(fresh.items())
    third, seen, _ = drive(runner, _staggered_requests(), slots=3, chunk=6)
    assert {r: q.output_ids for r, q in third.items()} == {r: q.output_ids for r, q in again.items()}
    _check_against_forward(model, third, seen)


def test_no_packed_projections_without_a_store_or_below_the_threshold():
    """Without a store nothing would say when copies go stale: none are made; the tiny models' projections are
    below PACK_MIN_ELEMENTS (oneDNN's per-call overhead outweighs its gain there): plain matmuls."""
    model = _tiny("qwen3")
    bare = PoolRunner(model, num_slots=3, capacity=32)
    small = PoolRunner(model, num_slots=3, capacity=32, weights=WeightStore(model))
    for runner in (bare, small):
        drive(runner, _staggered_requests(), slots=3, chunk=6)
        assert runner.prepacked_projections == 0 and runner._prepack == []


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
    rng = request_rng(0, "x")
    tok, lp = sample_token(logits, SamplingParams(temperature=0.0), rng)
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(logits, 0)[0]))
    tok, lp = sample_token(logits, SamplingParams(temperature=0.5, top_k=1), rng)
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(logits / 0.5, 0)[0]), abs=1e-6)
    counts = torch.zeros(4)
    for _ in range(400):
        counts[sample_token(logits, SamplingParams(temperature=1.0, top_p=0.7), rng)[0]] += 1
    assert counts[2:].sum() == 0 and counts[1] > 0  # p = .61, .22, .14, .03: top-p 0.7 keeps tokens 0, 1


def test_sample_batch_matches_one_row_reference():
    """Batched sampling picks exactly the reference's tokens (same per-request draws) and log-probs, for mixed
    temperatures (greedy included), top-k and top-p, including extreme logits and ties."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(60):
        rows, vocab = 1 + trial % 13, (5, 48, 301)[trial % 3]
        logits = torch.randn(rows, vocab, generator=gen) * (0.5, 4.0, 30.0)[trial % 3]
        if trial % 5 == 0:
            logits[:, : vocab // 2] = 1.0  # ties at the top
        params = [
            SamplingParams(
                temperature=(0.0, 0.7, 1.0, 1.5)[(trial + i) % 4],
                top_k=(-1, -1, 1, 3)[(trial + 2 * i) % 4],
                top_p=(1.0, 0.9, 0.5, 1e-6)[(trial + 3 * i) % 4],
            )
            for i in range(rows)
        ]
        rng_a = [request_rng(trial, f"r{i}") for i in range(rows)]
        rng_b = [request_rng(trial, f"r{i}") for i in range(rows)]
        for _ in range(3):
            tokens, logprobs = sample_batch(logits, params, rng_a)
            for i in range(rows):
                assert (tokens[i], logprobs[i]) == sample_token(logits[i], params[i], rng_b[i])
                checked += 1
    assert checked > 1000
    assert sample_batch(torch.zeros(0, 7), [], []) == ([], [])


def test_sample_batch_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -30.0])
    n = 20000
    rngs = [request_rng(1, str(i)) for i in range(n)]
    tokens, _ = sample_batch(logits.expand(n, -1), [SamplingParams(temperature=1.0)] * n, rngs)
    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    probs = torch.softmax(logits.double(), 0)
    assert (freq - probs).abs().max() < 4 * (probs * (1 - probs) / n).sqrt().max()
    tokens, _ = sample_batch(logits.expand(n, -1), [SamplingParams(temperature=1.0, top_k=2)] * n, rngs)
    assert set(tokens) == {0, 1}


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


def test_weight_store_resume_without_allocation_allocates_on_load():
    model = _tiny("qwen3", tie=True)
    store = WeightStore(model)
    full = store.allocated_bytes()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    store.release()
    store.resume(allocate=False)
    assert store.allocated_bytes() == 0 and len(store.pending) == len(original)
    with pytest.raises(EngineNotReady, match="not loaded"):
        store.check_ready()
    store.load([(n, t) for n, t in original.items() if "layers.1" not in n])
    with pytest.raises(EngineNotReady, match="layers.1"):
        store.check_ready()
    for n, t in original.items():
        if "layers.1" in n:
            store.load_one(n, t)
    store.check_ready()
    assert store.allocated_bytes() == full
    for n, p in model.named_parameters():
        assert torch.equal(p, original[n])


@pytest.fixture(scope="module")
def local_engine(tmp_path_factory):
    path = build_word_model(tmp_path_factory.mktemp("tiny"))
    eng = LocalEngine(LocalEngineConfig(model_path=str(path), max_running_requests=2, max_total_tokens=40))
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
    old = local_engine.scheduler.core.eos_ids
    local_engine.scheduler.core.eos_ids = {eos}
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
        local_engine.scheduler.core.eos_ids = old


def test_admission_budgets(local_engine):
    with pytest.raises(ValueError, match="max-total-tokens"):
        local_engine.submit_generate({"input_ids": [3] * 30, "sampling_params": {"max_new_tokens": 20}})
    with pytest.raises(
        ValueError, match=r"The input \(512 tokens\) is longer than the model's context length"
    ):
        local_engine.submit_generate({"input_ids": [3] * 512})
    with pytest.raises(
        ValueError, match="maximum context length of 512 tokens. You requested a total of 513"
    ):
        local_engine.submit_generate({"input_ids": [3] * 500, "sampling_params": {"max_new_tokens": 13}})
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
    path = build_word_model(tmp_path / "m")
    eng = LocalEngine(LocalEngineConfig(model_path=str(path), dtype="bfloat16"))
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
        LocalEngine(LocalEngineConfig(model_path=str(path), dtype="int8"))


def test_failed_decode_step_fails_only_the_batch(local_engine, monkeypatch):
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(local_engine.runner, "forward", broken)
    _, futs, _ = local_engine.submit_generate({"input_ids": [3, 4], "sampling_params": sp})
    with pytest.raises(RuntimeError, match="boom"):
        futs[0].result(30)
    monkeypatch.undo()
    assert len(_run(local_engine, {"input_ids": [3, 4], "sampling_params": sp})["output_ids"]) == 4


def test_a_step_raising_stop_iteration_answers_with_an_error(local_engine, monkeypatch):
    """StopIteration from the model (a Future cannot carry it into asyncio) fails the request, wrapped."""
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    def broken(*a, **k):
        raise StopIteration

    monkeypatch.setattr(local_engine.runner, "forward", broken)
    _, futs, _ = local_engine.submit_generate({"input_ids": [3, 4], "sampling_params": sp})
    with pytest.raises(RuntimeError, match="StopIteration") as info:
        futs[0].result(30)
    assert isinstance(info.value.__cause__, StopIteration)
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


def test_every_admin_route_has_an_engine_operation():
    """The server's admin routes name operations of the engine's dispatch table (and nothing else is in it)."""
    from unittest.mock import MagicMock

    from miles.engines.local.server import _ADMIN_POSTS

    ops = LocalEngine.admin_ops(MagicMock())
    assert set(ops) == {op for _, op, _ in _ADMIN_POSTS}


def test_update_weights_from_disk_names_a_missing_local_path(tmp_path) -> None:
    from miles.engines.local.control import missing_local_path

    for path in (str(tmp_path / "missing"), "./ckpt/iter_1", "~/models/x", "runs/a/hf"):
        assert missing_local_path(path) == f"model_path {path!r}: the path does not exist"
    assert missing_local_path(str(tmp_path)) is None  # exists
    assert missing_local_path("Qwen/Qwen3-0.6B") is None  # a Hub repo id: from_pretrained's business


def test_fallback_runner_prefill_chunks_with_nothing_to_sample():
    """A prompt longer than the prefill chunk, alone: its first forwards only feed tokens (no row samples), and
    the fallback runner must answer them with no logits rather than fail the batch."""
    model = _tiny("gpt2")
    runner = make_runner(model, num_slots=1, capacity=64)
    assert isinstance(runner, NoCacheRunner)
    done, seen, _ = drive(
        runner, {0: [_req("long", [(5 * j) % 60 + 1 for j in range(20)], 4)]}, slots=1, chunk=6
    )
    assert len(done["long"].output_ids) == 4
    _check_against_forward(model, done, seen)


def test_pool_runner_prefill_chunks_with_nothing_to_sample():
    """The KV-pool runner, a prompt longer than the prefill chunk alone: forwards where no row samples give no
    logits (an empty index list must still be an index tensor)."""
    model = _tiny("qwen3")
    runner = make_runner(model, num_slots=1, capacity=64)
    assert isinstance(runner, PoolRunner)
    done, seen, _ = drive(
        runner, {0: [_req("long", [(5 * j) % 60 + 1 for j in range(20)], 4)]}, slots=1, chunk=6
    )
    assert len(done["long"].output_ids) == 4
    _check_against_forward(model, done, seen)
