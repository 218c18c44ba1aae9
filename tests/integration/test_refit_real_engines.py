"""Colocated refit from a 2-rank FSDP2 trainer into two real embedded engines: after the refit every engine
tensor equals the trainer's tensor bit for bit (fp32), and the engines report the new weight version."""

from __future__ import annotations

import httpx
import torch

from miles.utils.types import Sample, SampleStatus
from tests.integration._util import run_distributed


def _trainer_body(rank: int, world: int, model_dir: str, urls: list[str], out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    cfg = parse_config([
        "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--actor-num-gpus-per-node", str(world), "--colocate", "--lr", "1e-2",
        "--update-weight-buffer-size", "4096",  # many buckets
    ])  # fmt: skip
    trainer = FSDPTrainer(cfg, rank, world)
    trainer.init("actor", with_ref=False)
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(4):
        tokens = torch.randint(3, 40, (9,), generator=g).tolist()
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                tokens=tokens,
                response_length=4,
                loss_mask=[1] * 4,
                rollout_log_probs=None,
                reward=float(i % 2),
                status=SampleStatus.COMPLETED,
            )
        )
    trainer.train(0, samples[2 * rank : 2 * rank + 2])  # move the weights away from the checkpoint
    trainer.update_weights(urls, weight_version="v1")
    state = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({k: v.clone() for k, v in state.items()}, out)


def test_refit_makes_engine_weights_equal_trainer_weights(tmp_path, two_tiny_engines):
    model_dir, procs = two_tiny_engines
    out = str(tmp_path / "trainer.pt")
    run_distributed(_trainer_body, 2, model_dir, [p.url for p in procs], out, init_pg=False)
    from transformers import AutoModelForCausalLM

    trainer = torch.load(out)
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(trainer[k], base[k]) for k in trainer), "training did not change the weights"
    for proc in procs:
        assert httpx.get(f"{proc.url}/model_info").json()["weight_version"] == "v1"
        for name, tensor in trainer.items():
            got = httpx.post(
                f"{proc.url}/get_weights_by_name",
                json={"name": name, "truncate_size": tensor.numel()},
                timeout=60,
            ).json()
            assert torch.equal(torch.tensor(got, dtype=torch.float32), tensor.flatten().float()), name
        # and the engine generates with them
        body = httpx.post(
            f"{proc.url}/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                "return_logprob": True,
            },
            timeout=60,
        ).json()
        assert body["meta_info"]["weight_version"] == "v1" and len(body["output_ids"]) >= 1
