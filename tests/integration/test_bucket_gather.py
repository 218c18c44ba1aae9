"""One all-gather per refit bucket, and the gather-free `row_copies` (every rank copies its own rows into shared
destinations): FSDP2 shards of uneven sizes (empty shards included), mixed dtypes, a cast, against DTensor's own
`full_tensor`, bit for bit, on 3 gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from miles.refit.buckets import hf_tensors, iter_weight_buckets, plan_weight_buckets, row_copies
from tests.integration._util import run_distributed


class _Odd(nn.Module):
    """Rows that 3 ranks do not divide evenly: 7 (3, 3, 1), 2 (1, 1, empty), 5-element biases, a 3-D tensor; a
    bf16 part and an integer buffer that is not sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(3, 2, bias=False)
        self.c = nn.Module()
        self.c.w = nn.Parameter(torch.randn(4, 3, 2))
        self.low = nn.Linear(6, 5).to(torch.bfloat16)
        self.register_buffer("steps", torch.arange(6, dtype=torch.int64))


def _body(rank: int, world_size: int, shared: str) -> None:
    torch.manual_seed(0)  # every rank starts from the same weights
    model = _Odd()
    with torch.no_grad():  # distinct values per tensor, so a misplaced row shows
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(p.dtype))
    mesh = init_device_mesh("cpu", (world_size,))
    for part in (model.a, model.b, model.c, model.low):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    want = {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in state.items()}
    if rank == 2:  # an empty shard takes part (b.weight: 2 rows over 3 ranks)
        assert state["b.weight"].to_local().numel() == 0

    for dtype in (None, torch.bfloat16):
        for bucket_bytes in (1, 64, 1 << 20):  # one tensor per bucket, a few, all in one
            buckets = list(iter_weight_buckets(model, bucket_bytes, dtype))
            assert [[n for n, _ in b] for b in buckets] == plan_weight_buckets(model, bucket_bytes, dtype)
            for name, t in (x for b in buckets for x in b):
                full = want[name]
                expected = full.to(dtype) if dtype is not None and full.is_floating_point() else full
                assert t.dtype == expected.dtype and torch.equal(t, expected), (name, dtype, bucket_bytes)

    # row_copies: every rank writes its own rows into destinations all ranks map (a shared file), no gather; a
    # non-contiguous view of a larger buffer included, nothing outside the views written; cast to dtype first
    entries = hf_tensors(model, None)
    for k, dtype in enumerate((None, torch.bfloat16)):
        flat = torch.from_file(f"{shared}-{k}", shared=True, size=2 * 200, dtype=torch.float64)
        store = flat[:200].view(20, 10)
        views, offset = [{}, {}], 0
        for e in entries:
            full = want[e.name]
            if e.name == "a.weight":  # a non-contiguous destination: 7 x 5 of the 20 x 10 store
                views[0][e.name] = store[:7, :5]
            else:  # float64 destinations: the cast to dtype shows (bf16 values, not the fp32 ones)
                views[0][e.name] = flat[200 + offset : 200 + offset + full.numel()].view(full.shape)
                offset += full.numel()
            views[1][e.name] = torch.zeros(full.shape, dtype=full.dtype)  # this rank's own: only its rows
        dist.barrier()
        for dst, src in row_copies(entries, dtype, views, rank, world_size):
            dst.copy_(src)
        dist.barrier()  # every rank wrote its rows
        for e in entries:
            full = want[e.name]
            expected = full.to(dtype) if dtype is not None and full.is_floating_point() else full
            assert torch.equal(views[0][e.name], expected.to(torch.float64)), (e.name, dtype)
            chunk = -(-full.shape[0] // world_size)
            mine = torch.zeros_like(full)
            mine[rank * chunk : (rank + 1) * chunk] = expected[rank * chunk : (rank + 1) * chunk]
            assert torch.equal(views[1][e.name], mine), (e.name, dtype)  # no rows of other ranks
        assert torch.count_nonzero(store[7:]) == 0 and torch.count_nonzero(store[:, 5:]) == 0
        assert torch.count_nonzero(flat[200 + offset :]) == 0
        dist.barrier()
    dist.barrier()


def test_bucket_gather_equals_full_tensor_on_uneven_shards(tmp_path) -> None:
    run_distributed(_body, 3, str(tmp_path / "shared"))
