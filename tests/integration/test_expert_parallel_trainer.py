"""The FSDP2 actor with --expert-model-parallel-size 2 trains exactly as with 1 (issue 28): gloo, 2 ranks, a tiny
Qwen3-MoE, fp32, rollout routing replay (R3, replayed experts other than the router's top-k) and the load-balancing
loss. One rollout's training step: the step's metrics (loss, gradient norm, ppo_kl, router losses) and every updated
weight equal within 1e-5 (relative 1e-6 for large values). The same with --context-parallel-size 2 (and the z-loss)
against one rank, and with EP2 x CP2 on 4 ranks against DP2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from miles.utils.types import Sample, SampleStatus
from tests.integration._util import run_distributed

LAYERS, EXPERTS, TOP_K, VOCAB = 2, 4, 2, 48


def _samples(rank: int) -> list[Sample]:
    """This rank's 4 samples (2 prompt groups of 2) with rollout log-probs and engine-routed experts."""
    rng = np.random.default_rng(100 + rank)
    samples = []
    for i in range(4):
        prompt, response = rng.integers(1, VOCAB, 3 + i).tolist(), rng.integers(1, VOCAB, 4 + i).tolist()
        n = len(prompt) + len(response)
        routed = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range((n - 1) * LAYERS)])
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                tokens=prompt + response,
                response_length=len(response),
                loss_mask=[1] * len(response),
                rollout_log_probs=(-rng.uniform(0.5, 3.0, len(response))).tolist(),
                rollout_routed_experts=routed.reshape(n - 1, LAYERS * TOP_K).astype(np.uint8),
                reward=float(i % 2),
                status=SampleStatus.COMPLETED,
            )
        )
    return samples


def _body(rank: int, world: int, model_dir: str, out: str, ep: int, cp: int, extra: list[str]) -> None:
    from torch.distributed.tensor import DTensor

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    args = ["--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "2"]
    dp = world // cp  # each replica trains on _samples(dp_rank): 4 samples
    args += [
        "--rollout-batch-size",
        str(2 * dp),
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        str(4 * dp),
    ]
    args += ["--actor-num-gpus-per-node", str(world), "--colocate", "--rollout-temperature", "0.8"]
    args += ["--lr", "1e-3", "--run-dir", os.path.dirname(model_dir), "--moe-aux-loss-coeff", "0.01"]
    args += ["--use-rollout-routing-replay", "--expert-model-parallel-size", str(ep)]
    args += ["--context-parallel-size", str(cp), *extra]
    trainer = FSDPTrainer(parse_config(args), rank, world)
    trainer.init("actor", with_ref=False)
    from miles.backends.fsdp_utils.expert_parallel import ExpertParallelExperts

    split = [m.local_experts for m in trainer.model.modules() if isinstance(m, ExpertParallelExperts)]
    assert split == ([EXPERTS // ep] * LAYERS if ep > 1 else []), split
    assert trainer.ps.cp_size == cp
    metrics = trainer.train(0, _samples(trainer.ps.dp_rank))
    params = {}
    for n, p in trainer.model.named_parameters():
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        params[n] = full.tolist()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"metrics": metrics, "params": params}, f)


def _run(tmp_path, ep: int, world: int = 2, cp: int = 1, extra: tuple[str, ...] = ()) -> dict:
    out = str(tmp_path / f"w{world}ep{ep}cp{cp}.json")
    model = str(tmp_path / "model")
    run_distributed(_body, world, model, out, ep, cp, list(extra), init_pg=False, timeout_s=600)
    with open(out) as f:
        return json.load(f)


def _save(tmp_path) -> None:
    from miles.tools.tiny_moe import build_tiny_moe

    build_tiny_moe(
        str(tmp_path / "model"),
        hidden_size=32,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        top_k=TOP_K,
        vocab_size=VOCAB,
        initializer_range=0.2,
    )


def _assert_same_step(ep1: dict, ep2: dict, tmp_path) -> None:
    keys = [
        k for k in ep1["metrics"] if k.startswith(("train/loss", "train/grad_norm", "train/moe/", "train/pg"))
    ]
    assert "train/moe/aux_loss" in keys and any(k.startswith("train/loss") for k in keys), sorted(
        ep1["metrics"]
    )
    for k in keys:
        a, b = ep1["metrics"][k], ep2["metrics"][k]
        assert abs(a - b) <= 1e-5 + 1e-6 * abs(a), (k, a, b)
    assert ep2["metrics"]["train/first_mb_ppo_kl_abs_max"] == 0.0
    assert ep1["params"].keys() == ep2["params"].keys()
    for n in ep1["params"]:
        a, b = torch.tensor(ep1["params"][n]), torch.tensor(ep2["params"][n])
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=lambda m, n=n: f"updated {n}: {m}")
    from transformers import AutoModelForCausalLM

    init = dict(
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32).named_parameters()
    )
    moved = [n for n in ep2["params"] if not torch.equal(torch.tensor(ep2["params"][n]), init[n].detach())]
    assert "model.layers.0.mlp.experts.gate_up_proj" in moved and len(moved) > len(init) // 2, moved
    print("compared:", {k: ep2["metrics"][k] for k in keys})


def test_ep2_trainer_step_equals_ep1(tmp_path):
    _save(tmp_path)
    _assert_same_step(_run(tmp_path, 1), _run(tmp_path, 2), tmp_path)


Z_LOSS = ("--moe-z-loss-coeff", "0.01")


def test_cp2_trainer_step_equals_one_rank(tmp_path):
    """R3, the aux and z losses with --context-parallel-size 2: the actor passes its CP group to the MoE hooks."""
    _save(tmp_path)
    one, cp2 = _run(tmp_path, 1, world=1, extra=Z_LOSS), _run(tmp_path, 1, world=2, cp=2, extra=Z_LOSS)
    assert one["metrics"]["train/moe/z_loss"] > 0
    _assert_same_step(one, cp2, tmp_path)


@pytest.mark.slow
def test_ep2_cp2_trainer_step_equals_dp2(tmp_path):
    _save(tmp_path)
    _assert_same_step(_run(tmp_path, 1), _run(tmp_path, 2, world=4, cp=2), tmp_path)
