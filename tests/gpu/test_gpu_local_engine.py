"""The embedded engine with `--device cuda` answers `/generate` (the app in process, no server): the model, the
KV pool and every tensor of a step live on the GPU, only the sampled ids come back. main's engine at fe4ea7d
answered HTTP 500 here (prompt ids made on the CPU, embedding on cuda:0)."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient

from miles.engines.local.engine import LocalEngine, LocalEngineConfig
from miles.engines.local.server import create_app
from miles.tools.tiny_model import build_tiny_model


def test_engine_on_cuda_generates_with_the_trainers_log_probs(tmp_path):
    path = build_tiny_model(tmp_path / "m", seed=0)
    engine = LocalEngine(LocalEngineConfig(model_path=str(path), device="cuda", max_running_requests=4))
    engine.start()
    try:
        assert engine.model.device.type == "cuda" and engine.runner.pool.data.device.type == "cuda"
        prompts = [[5, 6, 7, 8, 9], [10, 11], [12] * 9, [13, 14, 15], [16, 17, 18, 19]]  # > 4: slots reused
        body = {
            "input_ids": prompts,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True},
            "return_logprob": True,
        }
        with TestClient(create_app(engine)) as client:
            resp = client.post("/generate", json=body)
            assert resp.status_code == 200, resp.text
            outs = resp.json()
            info = client.get("/server_info").json()
        assert str(info.get("device", "")).startswith("cuda")
        for prompt, out in zip(prompts, outs):
            ids = out["output_ids"]
            assert len(ids) == 6
            got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
            seq = torch.tensor([prompt + ids], device="cuda")
            with torch.no_grad():
                logits = engine.model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt) :, None])[:, 0].cpu()
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    finally:
        engine.stop()
