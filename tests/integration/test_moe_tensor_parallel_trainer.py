"""The FSDP2 actor with --tensor-model-parallel-size 2 trains a Qwen3-MoE exactly as one rank does (issue 28):
gloo, a tiny Qwen3-MoE, fp32, rollout routing replay (R3, replayed experts other than the router's top-k) and the
load-balancing loss. TP2 on 2 ranks (one data-parallel rank: both see the same 8 samples) against TP1 on 1 rank:
the step's metrics (loss, gradient norm, ppo_kl, router losses) and every updated weight equal within 1e-5
(relative 1e-6 for large values)."""

from __future__ import annotations

import json
import os

import numpy as np

from miles.utils.types import Sample, SampleStatus
from tests.integration._util import run_distributed
from tests.integration.test_expert_parallel_trainer import _assert_same_step, _save

LAYERS, EXPERTS, TOP_K, VOCAB = 2, 4, 2, 48


def _samples() -> list[Sample]:
    """The step's 8 samples (4 prompt groups of 2) with rollout log-probs and engine-routed experts."""
    rng = np.random.default_rng(100)
    samples = []
    for i in range(8):
        prompt, response = rng.integers(1, VOCAB, 3 + i % 4).tolist(), rng.integers(1, VOCAB, 4 + i).tolist()
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


def _body(rank: int, world: int, model_dir: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    args = ["--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "2"]
    args += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8"]
    args += ["--actor-num-gpus-per-node", str(world), "--colocate", "--rollout-temperature", "0.8"]
    args += ["--lr", "1e-3", "--run-dir", os.path.dirname(model_dir), "--moe-aux-loss-coeff", "0.01"]
    args += ["--use-rollout-routing-replay", "--tensor-model-parallel-size", str(world)]
    trainer = FSDPTrainer(parse_config(args), rank, world)
    trainer.init("actor", with_ref=False)
    split = sum(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in trainer.model.parameters())
    assert split == (6 * LAYERS if world > 1 else 0), split
    metrics = trainer.train(0, _samples())
    params = {}
    for n, p in trainer.model.named_parameters():
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        params[n] = full.tolist()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"metrics": metrics, "params": params}, f)


def _run(tmp_path, world: int) -> dict:
    out = str(tmp_path / f"tp{world}.json")
    run_distributed(_body, world, str(tmp_path / "model"), out, init_pg=False)
    with open(out) as f:
        return json.load(f)


def test_moe_tp2_trainer_step_equals_tp1(tmp_path):
    _save(tmp_path)
    _assert_same_step(_run(tmp_path, 1), _run(tmp_path, 2), tmp_path)
