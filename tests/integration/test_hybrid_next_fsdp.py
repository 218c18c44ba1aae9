"""Tiny Qwen3-Next on FSDP2 over 2 gloo CPU ranks (fully_shard per decoder layer): each rank's packed micro-batch
(linear-attention layers reset per sequence, MoE aux loss on) gives the same loss, and one optimizer step the
same updated weights, as an unsharded reference that sees both ranks' packs (fp32, <= 1e-5)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from _util import run_distributed
from torch.distributed.fsdp import FSDPModule

from miles.backends.fsdp_utils.data_packing import pack_sequences
from miles.backends.fsdp_utils.forward import forward_packed
from miles.backends.fsdp_utils.hf_load import load_hf_model
from miles.backends.fsdp_utils.model import apply_fsdp2
from miles.backends.fsdp_utils.moe import MoETraining
from miles.backends.fsdp_utils.parallel import init_distributed
from miles.tools.tiny_next import build_tiny_next

LR = 1e-2


def _samples(rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(10 + rank)
    shapes = [(6, 5), (3, 2), (70, 4)] if rank == 0 else [(4, 9), (8, 3)]
    return [
        {"tokens": torch.randint(1, 40, (p + r,), generator=g).tolist(), "response_length": r}
        for p, r in shapes
    ]


def _loss(model: torch.nn.Module, samples: list[dict]) -> torch.Tensor:
    (pack,) = pack_sequences(samples, num_packs=1)
    moe = MoETraining(model, aux_loss_coeff=0.01)
    with moe.forward([s["tokens"] for s in samples], pack.sample_indices.tolist()) as cap:
        lps, _ = forward_packed(model, pack, 1.0)
    aux, _ = moe.loss(cap, num_micro_batches=1)
    return -torch.cat(lps).sum() + aux


def _body(rank: int, world: int, path: str) -> None:
    state = init_distributed("gloo", timeout_s=60)
    model = load_hf_model(path)
    ref = copy.deepcopy(model)
    apply_fsdp2(model, state.fsdp_mesh, torch.float32, torch.float32, False, True, per_layer=True)
    assert sum(isinstance(m, FSDPModule) for m in model.modules()) == 1 + model.config.num_hidden_layers
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = _loss(model, _samples(rank))
    (loss * world).backward()  # FSDP averages gradients over ranks: scale to the sum of the ranks' losses
    opt.step()
    ref_losses = [_loss(ref, _samples(r)) for r in range(world)]
    sum(ref_losses).backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    torch.testing.assert_close(loss.detach(), ref_losses[rank].detach(), atol=1e-5, rtol=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), atol=1e-5, rtol=1e-5, msg=name)
    assert not torch.equal(
        ref.model.layers[0].linear_attn.A_log, load_hf_model(path).model.layers[0].linear_attn.A_log
    )
    dist.barrier()


def test_tiny_next_fsdp2_step_equals_unsharded(tmp_path) -> None:
    path = str(build_tiny_next(tmp_path / "next", hidden_size=32))
    run_distributed(_body, 2, path, init_pg=False)
