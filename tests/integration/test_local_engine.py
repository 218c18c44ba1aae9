"""The embedded engine as a real HTTP server on a tiny random Qwen3: generation, batching, log-probs, refit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from miles.algo.logprobs import compute_log_probs
from miles.engines.local import cpu_attention
from miles.engines.sglang_engine import EngineHTTPError, EngineProcess
from miles.tools.tiny_model import build_word_model
from miles.utils.serialization import serialize, share_named_tensors

PROMPTS = [[3, 5, 7], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33]]
CONTEXT = 32768  # the model's context length: room for "endless" requests that tests abort
LONG = CONTEXT - 100


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_word_model(tmp_path_factory.mktemp("tiny_qwen3"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = EngineProcess(
        str(model_dir), kind="local", local_args={"num-threads": 1, "max-running-requests": 8}
    )
    with eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def gen(engine, ids, **sp):
    rl = sp.pop("return_logprob", False)
    rid = sp.pop("rid", None)
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": rl}
    if rid is not None:
        body["rid"] = rid
    return engine.post("/generate", body, timeout=60)


def greedy(engine, ids, n=8, **kw):
    return gen(engine, ids, max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def refit(engine, named, version=None):
    """One bucket inside a weight-update session (SGLang refuses refits outside one)."""
    shared = share_named_tensors(named)
    body = {"serialized_named_tensors": [serialize(shared)], "flush_cache": True}
    if version is not None:
        body["weight_version"] = version
    assert engine.post("/begin_weight_update", {})["success"]
    try:
        return engine.post("/update_weights_from_tensor", body)
    finally:
        assert engine.post("/end_weight_update", {})["success"]


def weight_version(engine):
    return engine.get("/model_info")["weight_version"]


@pytest.fixture(autouse=True)
def _never_left_paused(engine):
    yield
    engine.post("/continue_generation", {})
    engine.post("/abort_request", {"abort_all": True})


def test_info_endpoints(engine, model_dir):
    info = engine.get("/get_model_info")
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    info = engine.get("/get_server_info")
    assert info["kv_cache"] == "slot pool" and info["context_length"] == CONTEXT
    # one thread, float32 on CPU: decode attention runs in the C kernel (the log-prob tests below check it)
    if cpu_attention.find_compiler() is not None:
        assert info["decode_attention"].startswith("cpu kernel decode_attention_2x2x8_")
    else:
        assert info["decode_attention"] == "matmul"
    # slots x context x (2 layers x 2 KV heads x head_dim 8 x keys and values x 4 bytes)
    assert info["kv_cache_bytes"] == 8 * CONTEXT * 2 * 2 * 8 * 2 * 4
    assert engine.get("/health_generate") == {}


def test_max_new_tokens(engine):
    out = greedy(engine, PROMPTS[0], n=5)
    assert len(out["output_ids"]) == 5 and out["meta_info"]["completion_tokens"] == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["prompt_tokens"] == 3
    assert gen(engine, PROMPTS[0], max_new_tokens=0)["output_ids"] == []


def test_stop_token_ids(engine, tokenizer):
    ref = greedy(engine, PROMPTS[1], n=10)["output_ids"]
    k = 4
    stop_tok = ref[k]
    first = ref.index(stop_tok)
    out = greedy(engine, PROMPTS[1], n=10, stop_token_ids=[stop_tok])
    assert out["output_ids"] == ref[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["text"] == tokenizer.decode(ref[:first])
    kept = greedy(engine, PROMPTS[1], n=10, stop_token_ids=[stop_tok], no_stop_trim=True)
    assert kept["text"] == tokenizer.decode(ref[: first + 1])


def test_stop_strings(engine, tokenizer):
    ref = greedy(engine, PROMPTS[2], n=10)["output_ids"]
    stop = tokenizer.decode([ref[5]])
    j = next(i for i in range(len(ref)) if stop in tokenizer.decode(ref[: i + 1]))
    full = tokenizer.decode(ref[: j + 1])
    out = greedy(engine, PROMPTS[2], n=10, stop=[stop, "never-produced"])
    assert out["output_ids"] == ref[: j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.find(stop)]
    assert greedy(engine, PROMPTS[2], n=10, stop=stop, no_stop_trim=True)["text"] == full


def test_batch_matches_sequential_and_finishes_independently(engine):
    lens = [3, 12, 7, 1]
    seq = [greedy(engine, p, n=n)["output_ids"] for p, n in zip(PROMPTS, lens)]
    before = engine.get("/get_server_info")["internal_states"][0]
    sps = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lens]
    outs = engine.post("/generate", {"input_ids": PROMPTS, "sampling_params": sps})
    after = engine.get("/get_server_info")["internal_states"][0]
    assert [o["output_ids"] for o in outs] == seq
    assert [o["meta_info"]["completion_tokens"] for o in outs] == lens
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["decode_tokens"] - before["decode_tokens"]
    assert tokens == sum(n - 1 for n in lens)  # first token of each comes from prefill
    assert steps == max(lens) - 1  # one batched decode step per iteration, not one per request


def test_concurrent_http_requests_match_sequential(engine):
    seq = [greedy(engine, p, n=6)["output_ids"] for p in PROMPTS]
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = greedy(engine, PROMPTS[i], n=6)["output_ids"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [results[i] for i in range(len(PROMPTS))] == seq


@pytest.mark.parametrize(
    "sp",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 0.7, "top_p": 0.8, "top_k": 10},
        {"temperature": 0.0},
    ],
)
def test_logprobs_match_full_forward(engine, hf_model, sp):
    for i, prompt in enumerate(PROMPTS[:3]):
        out = gen(engine, prompt, max_new_tokens=12, ignore_eos=True, return_logprob=True, rid=f"lp{i}", **sp)
        ids = out["output_ids"]
        lp = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lp] == ids
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
        temp = sp["temperature"] if sp["temperature"] > 0 else 1.0
        ref = compute_log_probs(logits[len(prompt) - 1 : -1], torch.tensor(ids), temp)
        assert torch.allclose(torch.tensor([x for x, _, _ in lp]), ref, atol=1e-5, rtol=0)


def test_sampling_is_reproducible_per_rid(engine):
    sp = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    a = gen(engine, PROMPTS[0], rid="same", return_logprob=True, **sp)
    b = gen(engine, PROMPTS[0], rid="same", **sp)
    c = gen(engine, PROMPTS[0], rid="other", **sp)
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    # the same request inside a batch of 10 (more than --max-running-requests 8, rows of other lengths and
    # temperatures before and after it): same tokens, same log-probs (up to matmul blocking, which depends on the
    # number of rows: the 1e-5 of the trainer agreement)
    others = [[3 + i, 40 - i, 7][: 1 + i % 3] for i in range(9)]
    prompts = others[:4] + [PROMPTS[0]] + others[4:]
    sps = [{**sp, "max_new_tokens": 2 + 3 * (i % 5), "temperature": 0.6 + 0.2 * (i % 3)} for i in range(10)]
    sps[4] = sp
    rids = [f"crowd{i}" for i in range(10)]
    rids[4] = "same"
    body = {"input_ids": prompts, "sampling_params": sps, "rid": rids, "return_logprob": True}
    crowd = engine.post("/generate", body, timeout=60)[4]
    assert crowd["output_ids"] == a["output_ids"]
    lps = [[x for x, _, _ in o["meta_info"]["output_token_logprobs"]] for o in (a, crowd)]
    assert torch.allclose(torch.tensor(lps[0]), torch.tensor(lps[1]), atol=1e-5, rtol=0)


def test_bad_requests_are_rejected(engine):
    with pytest.raises(EngineHTTPError, match="temperature") as e:
        gen(engine, PROMPTS[0], temperature=-1)
    assert e.value.status == 400
    with pytest.raises(EngineHTTPError, match="unknown sampling params"):
        gen(engine, PROMPTS[0], bogus=1)
    with pytest.raises(EngineHTTPError, match="input_ids"):
        engine.post("/generate", {"input_ids": [10**6]})
    with pytest.raises(EngineHTTPError, match="unknown memory tags"):
        engine.post("/release_memory_occupation", {"tags": ["gpu"]})
    with pytest.raises(EngineHTTPError, match=f"maximum context length of {CONTEXT} tokens") as e:
        gen(engine, PROMPTS[0], max_new_tokens=CONTEXT - 2)  # SGLang refuses prompt + new > context
    assert e.value.status == 400


def test_refit_changes_outputs_and_version(engine, hf_model):
    original = [(n, p.detach().clone()) for n, p in hf_model.named_parameters()]
    base = greedy(engine, PROMPTS[1], n=10)["output_ids"]
    torch.manual_seed(1)
    changed = [(n, t + 0.5 * torch.randn_like(t)) for n, t in original]
    assert refit(engine, changed, version="v1")["success"]
    assert weight_version(engine) == "v1"
    out = greedy(engine, PROMPTS[1], n=10)
    assert out["output_ids"] != base and out["meta_info"]["weight_version"] == "v1"
    names = [n for n, _ in changed][:3]
    got = engine.post("/get_weights_by_name", {"name": names[2], "truncate_size": 5})
    assert torch.allclose(torch.tensor(got), dict(changed)[names[2]].flatten()[:5])
    assert refit(engine, original, version="v2")["success"]
    assert greedy(engine, PROMPTS[1], n=10)["output_ids"] == base
    flat = torch.cat([x.flatten() for _, x in changed])
    offsets = torch.tensor([0] + [x.numel() for _, x in changed]).cumsum(0).tolist()
    meta = [
        {
            "name": n,
            "shape": list(x.shape),
            "dtype": x.dtype,
            "start_idx": s,
            "end_idx": e,
            "numel": x.numel(),
        }
        for (n, x), s, e in zip(changed, offsets[:-1], offsets[1:])
    ]
    bucket = serialize({"flattened_tensor": flat.share_memory_(), "metadata": meta})
    body = {"serialized_named_tensors": [bucket], "load_format": "flattened_bucket", "weight_version": "v3"}
    engine.post("/begin_weight_update", {})
    assert engine.post("/update_weights_from_tensor", body)["success"]
    engine.post("/end_weight_update", {})
    assert greedy(engine, PROMPTS[1], n=10)["output_ids"] == out["output_ids"]
    assert refit(engine, original)["success"]
    with pytest.raises(EngineHTTPError, match="shape mismatch"):
        refit(engine, [(original[0][0], torch.zeros(3))])
    with pytest.raises(EngineHTTPError, match="unknown parameter"):
        refit(engine, [("not.a.param", torch.zeros(3))])


def test_release_resume_refit_restores_outputs(engine, hf_model):
    original = [(n, p.detach().clone()) for n, p in hf_model.named_parameters()]
    base = greedy(engine, PROMPTS[3], n=10)
    pool_bytes = engine.get("/get_server_info")["kv_cache_bytes"]
    assert engine.post("/release_memory_occupation", {}) is None  # SGLang answers an empty body
    info = engine.get("/get_server_info")
    assert info["weights_released"] and info["kv_cache_bytes"] == 0 < pool_bytes
    with pytest.raises(EngineHTTPError, match="released") as e:
        greedy(engine, PROMPTS[3])
    assert e.value.status == 503
    with pytest.raises(EngineHTTPError, match="released"):
        refit(engine, original)
    assert engine.post("/resume_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]}) is None
    assert engine.get("/get_server_info")["kv_cache_bytes"] == pool_bytes
    with pytest.raises(EngineHTTPError, match="not loaded since resume") as e:
        greedy(engine, PROMPTS[3])
    assert e.value.status == 503
    missing = original[-1][0]
    refit(engine, original[:-1])
    with pytest.raises(EngineHTTPError, match=missing):
        greedy(engine, PROMPTS[3])
    refit(engine, original[-1:])
    again = greedy(engine, PROMPTS[3], n=10)
    assert again["output_ids"] == base["output_ids"]


def _start_long(engine, rid, results):
    def run():
        results[rid] = gen(engine, PROMPTS[0], max_new_tokens=LONG, ignore_eos=True, temperature=1.0, rid=rid)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 20
    while engine.get("/get_server_info")["internal_states"][0]["num_running"] < 1:
        assert time.monotonic() < deadline, "long request never started running"
        time.sleep(0.05)
    return t


def test_abort_request(engine):
    results: dict[str, dict] = {}
    t = _start_long(engine, "long-abort", results)
    assert engine.post("/abort_request", {"rid": "long-abort"})["success"]
    t.join(20)
    fr = results["long-abort"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort"
    assert 0 < results["long-abort"]["meta_info"]["completion_tokens"] < LONG


def test_pause_abort_mode_then_continue(engine):
    results: dict[str, dict] = {}
    t = _start_long(engine, "long-pause", results)
    assert engine.post("/pause_generation", {"mode": "abort"})["status"] == "ok"
    t.join(20)
    assert results["long-pause"]["meta_info"]["finish_reason"]["type"] == "abort"
    late = threading.Thread(target=lambda: results.update(late=greedy(engine, PROMPTS[0], n=3)))
    late.start()
    late.join(1.0)
    assert late.is_alive() and "late" not in results  # held while paused
    assert engine.post("/continue_generation", {})["status"] == "ok"
    late.join(20)
    assert results["late"]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_holds_running_requests(engine):
    results: dict[str, dict] = {}
    t = _start_long(engine, "long-hold", results)
    assert engine.post("/pause_generation", {"mode": "in_place"})["status"] == "ok"
    s1 = engine.get("/get_server_info")["internal_states"][0]
    time.sleep(0.5)
    s2 = engine.get("/get_server_info")["internal_states"][0]
    assert s1["decode_tokens"] == s2["decode_tokens"], (s1, s2)
    assert s2["num_running"] == 1, s2
    assert engine.post("/continue_generation", {})["status"] == "ok"
    time.sleep(0.2)
    assert engine.post("/abort_request", {"abort_all": True})["success"]
    t.join(20)
    assert results["long-hold"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_release_while_a_request_runs_is_refused_and_a_control_release_waits_for_idle(engine):
    """SGLang's scheduler asserts idleness on /release_memory_occupation (and dies); the embedded engine refuses
    with its words, and /flush_cache answers 400 while a request runs. `EngineMemoryControl.release_memory`
    retries the flush until the engine is idle: it times out naming the engine while the request stays, and
    releases once the request has ended."""
    from miles.utils import engine_control_http as eh

    results: dict[str, dict] = {}
    t = _start_long(engine, "long-release", results)
    assert engine.post("/pause_generation", {"mode": "in_place"})["status"] == "ok"  # held running
    with pytest.raises(
        EngineHTTPError, match="release_memory_occupation should be called only when server is idle"
    ) as e:
        engine.post("/release_memory_occupation", {})
    assert e.value.status == 400
    with pytest.raises(
        EngineHTTPError, match=r"Cache not flushed because there are pending requests.*#running-req: 1"
    ):
        engine.post("/flush_cache", {})
    control = eh.EngineMemoryControl([engine.url], engine.admin_api_key, timeout=1.5)
    with pytest.raises(eh.EngineTimeout, match=rf"engine {engine.url}, flush_cache, .*not idle within 1.5 s"):
        control.release_memory(["kv_cache"])
    assert engine.get("/get_server_info")["internal_states"][0]["num_running"] == 1  # nothing was released

    def end_request() -> None:
        time.sleep(1.0)
        engine.post("/continue_generation", {})
        engine.post("/abort_request", {"abort_all": True})

    ender = threading.Thread(target=end_request)
    ender.start()
    eh.EngineMemoryControl([engine.url], engine.admin_api_key, timeout=30).release_memory(["kv_cache"])
    ender.join(20)
    t.join(20)
    assert results["long-release"]["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(EngineHTTPError, match="kv cache|released"):
        greedy(engine, PROMPTS[0], n=2)  # released indeed
    assert engine.post("/resume_memory_occupation", {"tags": ["kv_cache"]}) is None
    assert greedy(engine, PROMPTS[0], n=2)["meta_info"]["finish_reason"]["type"] == "length"


def test_decode_throughput_batch(engine):
    sps = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True}
    before = engine.get("/get_server_info")["internal_states"][0]
    engine.post("/generate", {"input_ids": [PROMPTS[i % 4] for i in range(8)], "sampling_params": sps})
    after = engine.get("/get_server_info")["internal_states"][0]
    tok = after["decode_tokens"] - before["decode_tokens"]
    secs = after["decode_seconds"] - before["decode_seconds"]
    print(
        f"\nembedded engine decode throughput, batch 8: {tok / secs:.0f} tokens/s ({tok} tokens, {secs:.2f} s)"
    )
    assert tok == 8 * 63


def test_update_weights_from_disk(engine, hf_model, tmp_path):
    base = greedy(engine, PROMPTS[0], n=10)["output_ids"]
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    other.save_pretrained(tmp_path / "flipped")
    res = engine.post(
        "/update_weights_from_disk", {"model_path": str(tmp_path / "flipped"), "weight_version": "d1"}
    )
    assert res["success"] and weight_version(engine) == "d1"
    assert greedy(engine, PROMPTS[0], n=10)["output_ids"] != base
    assert engine.post("/update_weights_from_disk", {"model_path": engine.model_path})["success"]
    assert greedy(engine, PROMPTS[0], n=10)["output_ids"] == base
    with pytest.raises(EngineHTTPError, match="update_weights_from_disk") as e:
        engine.post("/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert e.value.status == 400
    assert "the path does not exist" in str(e.value) and "Repo id" not in str(e.value)


def test_update_weights_from_distributed(engine, hf_model):
    import torch.distributed as dist

    from miles.utils.net import free_port
    from miles.utils.side_group import init_side_group

    base = greedy(engine, PROMPTS[2], n=10)["output_ids"]
    port, group = free_port(), "miles_refit_test"
    results: dict[str, object] = {}
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group,
        "backend": "gloo",
    }
    t = threading.Thread(target=lambda: results.update(init=engine.post("/init_weights_update_group", body)))
    t.start()
    pg = init_side_group("127.0.0.1", port, 0, 2, group, "gloo", 60.0)  # the trainer's side
    t.join(30)
    assert results["init"]["success"]
    named = [(n, p.detach().clone()) for n, p in hf_model.named_parameters()]
    torch.manual_seed(2)
    changed = [(n, x + 0.5 * torch.randn_like(x)) for n, x in named]

    def broadcast(tensors, version):
        meta = {
            "names": [n for n, _ in tensors],
            "dtypes": [str(x.dtype).removeprefix("torch.") for _, x in tensors],
            "shapes": [list(x.shape) for _, x in tensors],
            "group_name": group,
            "weight_version": version,
        }
        assert engine.post("/begin_weight_update", {})["success"]
        th = threading.Thread(
            target=lambda: results.update(upd=engine.post("/update_weights_from_distributed", meta))
        )
        th.start()
        for _, x in tensors:
            dist.broadcast(x, src=0, group=pg)
        th.join(30)
        assert engine.post("/end_weight_update", {})["success"]
        assert results["upd"]["success"]

    try:
        broadcast(changed, "dist-1")
        out = greedy(engine, PROMPTS[2], n=10)
        assert out["output_ids"] != base and out["meta_info"]["weight_version"] == "dist-1"
        broadcast(named, "dist-2")
        assert greedy(engine, PROMPTS[2], n=10)["output_ids"] == base
    finally:
        assert engine.post("/destroy_weights_update_group", {"group_name": group})["success"]
        dist.destroy_process_group(pg)


def test_client_disconnect_aborts_request(engine):
    import httpx

    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(engine.url + "/generate", json=body, timeout=1.0, trust_env=False)
    deadline = time.monotonic() + 10
    while engine.get("/get_server_info")["internal_states"][0]["num_running"] > 0:
        assert time.monotonic() < deadline, "request kept running after its client left"
        time.sleep(0.1)
