"""The embedded engine's core on CUDA: KV pool, mixed prefill/decode batches and the sampler on the device."""

from __future__ import annotations

import pytest
import torch

from miles.engines.local.model_runner import PoolRunner, make_runner
from miles.engines.local.sampling import SamplingParams, request_rng, sample_batch
from miles.engines.local.scheduler import Request, Scheduler


def _model():
    from miles.tools.tiny_model import tiny_config, tiny_model

    # hidden 64, head_dim 16
    config = tiny_config(128, max_position_embeddings=256, tie_word_embeddings=False)
    return tiny_model(config, seed=0).to("cuda", torch.float32).eval()


def _drive(runner, arrivals, slots, chunk):
    sched = Scheduler(slots, 64, set(), lambda ids, skip: "", None, chunk)
    seen, done, step = {}, {}, 0
    while arrivals or sched.has_work():
        for req in arrivals.pop(step, []):
            sched.add(req)
        step += 1
        batch = sched.schedule()
        if batch is None:
            continue
        rows = batch.sample_rows
        logits = runner.forward(batch)
        assert logits.device.type == "cuda"
        for row, lg in zip(rows, logits):
            seen.setdefault(row.req.rid, []).append(lg)
        sched.postprocess(
            batch, *sample_batch(logits, [r.req.params for r in rows], [r.req.rng for r in rows])
        )
        done.update((r.rid, r) for r in sched.pop_finished())
    return done, seen


def _req(rid, prompt, n, temperature):
    sp = SamplingParams(temperature=temperature, top_p=0.95, max_new_tokens=n, ignore_eos=True)
    return Request(rid, prompt, sp, rng=request_rng(0, rid))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pool_runner_on_cuda_matches_hf_and_batching(temperature):
    model = _model()
    runner = make_runner(model, num_slots=4, capacity=64)
    assert isinstance(runner, PoolRunner) and runner.pool.data.device.type == "cuda"
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 30)), [40], [50, 51, 52]]
    reqs = [_req(f"r{i}", p, 4 + 3 * (i % 3), temperature) for i, p in enumerate(prompts)]
    done, seen = _drive(runner, {0: reqs[:3], 2: reqs[3:]}, slots=4, chunk=8)
    for rid, req in done.items():
        seq = req.input_ids + req.output_ids
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([seq], device="cuda")).logits[0, len(req.input_ids) - 1 : -1]
        torch.testing.assert_close(torch.stack(seen[rid]), ref.float(), atol=1e-4, rtol=1e-4)
    alone, _ = _drive(make_runner(model, 1, 64), {0: [_req("r2", prompts[2], 10, temperature)]}, 1, None)
    assert alone["r2"].output_ids == done["r2"].output_ids
    runner.release_kv()
    assert runner.kv_allocated_bytes() == 0
    runner.resume_kv()
    assert runner.kv_allocated_bytes() == runner.pool.nbytes
