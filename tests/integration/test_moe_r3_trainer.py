"""The FSDP2 actor on a tiny Qwen3-MoE (gloo, 1 rank): with --use-rollout-routing-replay its log-probs equal a
rollout engine's that routed some tokens to other experts than the trainer's top-k (within 1e-5, and the first
micro-batch's ppo_kl is 0); without R3 they differ. Router losses and expert-load metrics are reported."""

from __future__ import annotations

import json
import os

import torch

from miles.utils.types import Sample, SampleStatus
from tests.integration._util import run_distributed


def _engine_rollout(model_dir: str) -> list[Sample]:
    """Samples generated as an engine that breaks the top-k differently would: on every third token each layer
    uses its 2nd and 3rd best experts. Log-probs and routed experts (SGLang's layout) come from that forward."""
    from transformers import AutoModelForCausalLM

    from miles.algo.logprobs import compute_log_probs
    from miles.backends.fsdp_utils.moe import moe_routers, moe_routing
    from miles.utils.routed_experts import decode_routed_experts, encode_routed_experts

    g = torch.Generator().manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers, vocab = len(moe_routers(model)), model.config.vocab_size
    samples = []
    for i in range(8):
        p, r = 3 + i % 3, 2 + i % 4
        tokens = torch.randint(1, vocab, (p + r,), generator=g)
        with torch.no_grad():
            with moe_routing(model) as own:
                model(tokens[None])
            forced = torch.full((p + r, layers, 2), -1, dtype=torch.long)
            for layer in range(layers):
                forced[::3, layer] = own.logits[layer].argsort(-1, descending=True)[::3, 1:3]
            with moe_routing(model, forced) as cap:
                logits = model(tokens[None]).logits[0]
        lp = compute_log_probs(logits[p - 1 : -1], tokens[p:], 0.8)
        routed = encode_routed_experts(cap.stacked_experts()[:-1].numpy())
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                tokens=tokens.tolist(),
                response_length=r,
                loss_mask=[1] * r,
                rollout_log_probs=lp.tolist(),
                rollout_routed_experts=decode_routed_experts(routed, p + r - 1),
                reward=float(i % 2),
                status=SampleStatus.COMPLETED,
            )
        )
    return samples


def _body(rank: int, world: int, model_dir: str, out: str, extra: list[str]) -> None:
    from miles.backends.fsdp_utils import rollout_batch as rb
    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    samples = _engine_rollout(model_dir)
    args = ["--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "2"]
    args += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "4"]
    args += ["--actor-num-gpus-per-node", "1", "--colocate", "--rollout-temperature", "0.8", "--lr", "1e-3"]
    args += ["--run-dir", os.path.dirname(model_dir), "--moe-aux-loss-coeff", "0.01"]
    trainer = FSDPTrainer(parse_config(args + extra), rank, world)
    trainer.init("actor", with_ref=False)
    trainer.reuse_training_forward = False  # the separate old log-probs pass is the one compared here
    batch = rb.RankBatch.from_samples(samples, trainer.ps.device)
    steps = rb.plan_steps(batch, trainer.config, trainer.ps, trainer.steps_per_rollout)
    trainer.moe.start_batch([s.rollout_routed_experts for s in samples])
    with torch.no_grad():
        lps = trainer._log_probs(trainer.model, batch, steps)
    gap = max(float((a - torch.tensor(s.rollout_log_probs)).abs().max()) for a, s in zip(lps, samples))
    metrics = trainer.train(0, samples)
    with open(out, "w") as f:
        json.dump({"gap": gap, **metrics}, f)


def _run(tmp_path, name: str, extra: list[str]) -> dict:
    from miles.tools.tiny_moe import build_tiny_moe

    model_dir = str(tmp_path / "model")
    if not os.path.exists(model_dir):
        build_tiny_moe(model_dir, hidden_size=32, initializer_range=0.2)
    out = str(tmp_path / f"{name}.json")
    run_distributed(_body, 1, model_dir, out, extra, init_pg=False)
    with open(out) as f:
        return json.load(f)


def test_r3_trainer_matches_engine_routing_and_without_it_does_not(tmp_path):
    r3 = _run(tmp_path, "r3", ["--use-rollout-routing-replay"])
    plain = _run(tmp_path, "plain", [])
    assert r3["gap"] <= 1e-5, r3["gap"]
    assert plain["gap"] > 1e-4, plain["gap"]
    for m in (r3, plain):
        assert m["train/first_mb_ppo_kl_abs_max"] == 0.0
        assert m["train/moe/load_max_over_mean"] >= 1.0
        assert m["train/moe/aux_loss"] > 0
    print(
        f"R3 gap {r3['gap']:.2e}, without R3 {plain['gap']:.2e}; load max/mean {r3['train/moe/load_max_over_mean']:.3f}"
    )
