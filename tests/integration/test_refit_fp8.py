"""--rollout-weight-quantization fp8 into real embedded engines, through `FSDPTrainer`, on both transports:

the linear weights travel as e4m3 with their `_scale_inv` block scales (tensor handles when colocated, where the
weight window is skipped; bytes on the broadcast group, which has no FP8 type on gloo), the engine dequantizes
them on load, and its `/weights_checker` answers the checksums of the FP8 tensors it received, so
--check-weight-update-equal passes. Every engine tensor equals the dequantized FP8 of the trainer's (linear
weights) or the trainer's own (everything else), bit for bit.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.integration._util import run_distributed
from tests.integration.test_refit_transfer_modes import _post, _samples


def _body(rank: int, world: int, model_dir: str, urls: list[str], mode: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config
    from miles.refit.fp8 import dequantize_block_fp8, is_quantized, quantize_block_fp8

    colocated = mode == "tensor"
    placement = ["--colocate"] if colocated else ["--rollout-num-gpus", "2"]
    cfg = parse_config([
        "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "3",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--actor-num-gpus-per-node", str(world), *placement, "--lr", "1e-2",
        "--update-weight-transfer-mode", mode, "--check-weight-update-equal",
        "--rollout-weight-quantization", "fp8", "--update-weight-buffer-size", "4096",
    ])  # fmt: skip
    assert cfg.engine.rollout_fp8_scale_format == "float"
    trainer = FSDPTrainer(cfg, rank, world)
    trainer.init("actor", with_ref=False)
    trainer.train(0, _samples(0, rank))
    if colocated and rank == 0:
        for url in urls:
            _post(url, "release_memory_occupation", {"tags": ["weights"]})
            _post(url, "resume_memory_occupation", {"tags": ["weights"]})
    dist.barrier()
    trainer.update_weights(urls, weight_version="v1")  # checksums compared inside (check_equal)
    kind = type(trainer._refitter.transport).__name__
    assert kind == ("ColocatedWeightUpdater" if colocated else "DistributedWeightUpdater"), kind
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(trainer.model, options=opts)
    if rank != 0:
        return
    quantized = 0
    for name, tensor in state.items():
        want = tensor.float()
        if is_quantized(name, tensor):
            want, quantized = dequantize_block_fp8(*quantize_block_fp8(tensor)), quantized + 1
            assert not torch.equal(want, tensor.float()), name  # FP8 really lost precision
        for url in urls:
            got = httpx.post(
                f"{url}/get_weights_by_name", json={"name": name, "truncate_size": tensor.numel()}, timeout=60
            ).json()
            assert torch.equal(torch.tensor(got, dtype=torch.float32), want.flatten()), (url, name)
    assert quantized >= 7  # q/k/v/o and gate/up/down of every layer
    sums = httpx.post(f"{urls[0]}/weights_checker", json={"action": "checksum"}, timeout=60).json()
    assert any(n.endswith("q_proj.weight_scale_inv") for n in sums["ranks"][0]["checksums"])


@pytest.mark.parametrize("mode", ["tensor", "broadcast"])
def test_fp8_refit_dequantizes_in_the_engine_and_checksums_agree(two_tiny_engines, mode):
    model_dir, procs = two_tiny_engines
    run_distributed(_body, 2, model_dir, [p.url for p in procs], mode, init_pg=False)
