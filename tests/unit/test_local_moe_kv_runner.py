"""The embedded engine serves Qwen3-MoE with its KV-cache runner (issue 28): greedy tokens, log-probs and routed
experts (SGLang's layout) equal those of the full-forward runner and of HF's forward, with chunked prefill, several
requests in flight, a prompt shared by two requests, the off-top-k test aid, layers mixing dense MLPs and MoE
blocks, after a retract, and after a refit under SGLang's per-expert names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.engines.local import engine as engine_mod
from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.engines.local.full_forward import NoCacheRunner
from miles.engines.local.model_runner import PoolRunner, supports_kv_cache
from miles.engines.local.routing_capture import PoolRouting, RecordingRunner, routing_runner
from miles.engines.local.sampling import SamplingParams, sample_batch
from miles.engines.local.scheduler import Request, Scheduler
from miles.refit.moe_names import split_bucket
from miles.tools.tiny_model import save_model_dir
from miles.tools.tiny_moe import build_tiny_moe, tiny_moe_config, tiny_moe_model
from miles.utils.routed_experts import decode_routed_experts

# two identical short prompts first (fed once, as a copy), then prompts longer than the 4-token prefill chunk;
# five requests on three slots: later ones wait, finished ones free slots (the last slot's request moves)
PROMPTS = [[8, 9], [8, 9], [3, 4, 5, 6, 7, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19], [20]]
MAX_NEW = [5, 7, 6, 3, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    sparse = build_tiny_moe(root / "sparse", hidden_size=32, initializer_range=0.2)
    return {"sparse": str(sparse), "mixed": str(_mixed_model(root / "mixed", sparse))}


def _mixed_model(path: Path, tokenizer_dir: Path) -> Path:
    """Three layers, the middle one a dense MLP (Qwen3-MoE's `mlp_only_layers`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_moe_config(len(tok), hidden_size=32, num_layers=3, initializer_range=0.2)
    config.mlp_only_layers = [1]
    with torch.random.fork_rng(devices=[]):
        model = tiny_moe_model(config, 1)
    save_model_dir(model, tok, path)
    return path


def _engine(path: str, full_forward: bool = False, **kw) -> LocalEngine:
    config = LocalEngineConfig(
        model_path=path,
        max_running_requests=3,
        chunked_prefill_size=4,
        cpu_decode_kernel=False,  # it compiles in a subprocess (not in tests/unit)
        enable_return_routed_experts=True,
        **kw,
    )
    with pytest.MonkeyPatch.context() as mp:
        if full_forward:  # the runner MoE models had before: a full forward per step
            mp.setattr(engine_mod, "make_runner", lambda model, *args, **kwargs: NoCacheRunner(model))
        eng = LocalEngine(config)
    eng.start()
    return eng


def _generate(eng: LocalEngine) -> list[dict]:
    futs = []
    for prompt, n in zip(PROMPTS, MAX_NEW):
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True,
            "return_routed_experts": True,
        }
        futs += eng.submit_generate(body)[1]
    return [f.result(120) for f in futs]


def _logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def _check_hf(model: torch.nn.Module, outs: list[dict]) -> None:
    """HF's full forward over prompt + output: its greedy token at every output position, its log-probs."""
    for prompt, out in zip(PROMPTS, outs):
        tokens = prompt + out["output_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1)
        assert logp.argmax(-1).tolist() == out["output_ids"]
        want = logp.gather(-1, torch.tensor(out["output_ids"])[:, None])[:, 0]
        torch.testing.assert_close(_logprobs(out), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,off_every", [("sparse", 0), ("sparse", 3), ("mixed", 0)])
def test_kv_runner_equals_full_forward_and_hf(models, kind, off_every):
    path = models[kind]
    kv = _engine(path, test_off_top_k_every=off_every)
    try:
        assert isinstance(kv.runner, PoolRunner) and isinstance(kv.runner.routing, PoolRouting)
        assert kv.server_info("h", 0)["kv_cache"] == "slot pool"
        outs = _generate(kv)
        if off_every:  # the test aid routes by position in the model's own forward too (hooks on the routers)
            _check_hf(kv.model, outs)
    finally:
        kv.stop()
    full = _engine(path, full_forward=True, test_off_top_k_every=off_every)
    try:
        assert isinstance(full.runner, RecordingRunner)
        ref = _generate(full)
    finally:
        full.stop()
    layers = 3 - 1 if kind == "mixed" else 2  # MoE layers
    for prompt, out, want in zip(PROMPTS, outs, ref):
        assert out["output_ids"] == want["output_ids"]
        torch.testing.assert_close(_logprobs(out), _logprobs(want), atol=1e-5, rtol=0)
        rows = len(prompt) + len(out["output_ids"]) - 1
        routed = decode_routed_experts(out["meta_info"]["routed_experts"], rows)
        assert routed.shape == (rows, layers * 2)
        assert (routed == decode_routed_experts(want["meta_info"]["routed_experts"], rows)).all()
    assert outs[0]["output_ids"] == outs[1]["output_ids"][:5]  # the shared prompt: the same greedy start
    if not off_every:
        from transformers import AutoModelForCausalLM

        _check_hf(AutoModelForCausalLM.from_pretrained(path).eval(), outs)


def test_kv_runner_after_a_per_expert_refit(models, tmp_path):
    """A refit under SGLang's per-expert names (`mlp.experts.M.{gate,up,down}_proj.weight`) reaches the MoE blocks
    the KV-cache runner calls: its greedy tokens and log-probs are then the new weights' (HF's forward)."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(models["sparse"]).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    eng = _engine(models["sparse"])
    try:
        before = _generate(eng)
        pieces = split_bucket(list(source.state_dict().items()))
        assert any(".mlp.experts.3.down_proj.weight" in n for n, _ in pieces)
        eng.weights.load(pieces)
        eng.weights.check_ready()
        after = _generate(eng)
    finally:
        eng.stop()
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
    _check_hf(source, after)


def test_qwen3_next_and_sliding_windows_stay_on_the_full_forward():
    """Linear-attention layers keep a recurrent state, not per-position keys/values; a sliding window is not what
    the pool's attention computes: neither gets the KV-cache runner."""
    from transformers import Qwen3NextConfig

    class _Model:
        def __init__(self, config):
            self.config = config

    ok, why = supports_kv_cache(_Model(Qwen3NextConfig()))  # type: ignore[arg-type]
    assert not ok and "qwen3_next" in why
    windowed = tiny_moe_config(48, hidden_size=32)
    windowed.use_sliding_window, windowed.sliding_window = True, 8
    ok, why = supports_kv_cache(_Model(windowed))  # type: ignore[arg-type]
    assert not ok and why == "sliding-window attention"


def _drive(runner: PoolRunner, retract_at: int | None) -> dict[str, Request]:
    """The engine loop's steps over the real scheduler (3 slots, 4-token chunks); at step `retract_at` every
    running request is retracted (SGLang's retract-mode pause): its KV cache goes, it prefills prompt + outputs
    again."""
    sched = Scheduler(3, 64, set(), lambda ids, skip: "", None, 4)
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        sched.add(Request(f"r{i}", list(prompt), params, return_routed_experts=True))
    done: dict[str, Request] = {}
    step = 0
    while sched.has_work():
        if step == retract_at:
            assert sched.retract_all() == 3
        step += 1
        batch = sched.schedule()
        assert batch is not None
        rows = batch.sample_rows
        logits = runner.forward(batch)
        sched.postprocess(
            batch, *sample_batch(logits, [r.req.params for r in rows], [r.req.rng for r in rows])
        )
        done.update((r.rid, r) for r in sched.pop_finished())
    return done


def test_retracted_requests_record_their_experts_again(models):
    """A retract drops the KV cache mid-generation; the re-prefill records every position again: the routed
    experts (and tokens) equal an uninterrupted run's, each position once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["sparse"]).eval()
    runner = PoolRunner(model, num_slots=3, capacity=64)
    assert routing_runner(runner, model, True, 3) is runner
    plain, retracted = _drive(runner, None), _drive(runner, 4)
    assert plain.keys() == retracted.keys() == {f"r{i}" for i in range(len(PROMPTS))}
    assert any(r.retractions for r in retracted.values())
    for rid, req in plain.items():
        again = retracted[rid]
        assert again.output_ids == req.output_ids
        assert req.routed_experts is not None and again.routed_experts is not None
        assert req.routed_experts.shape == (req.num_tokens - 1, 2, 2)  # the last token is never fed
        assert torch.equal(again.routed_experts, req.routed_experts)
