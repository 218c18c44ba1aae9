"""One all-gather per refit bucket: FSDP2 shards of uneven sizes (empty shards included), mixed dtypes, a cast,
and destinations the rows are unpacked into, against DTensor's own `full_tensor`, bit for bit, on 3 gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from miles.backends.fsdp_utils.update_weight_utils import (
    Bucket,
    RefitJob,
    iter_weight_buckets,
    plan_weight_buckets,
    stream_buckets,
)
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


def _body(rank: int, world_size: int) -> None:
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

    # destinations: a non-contiguous view of the right shape is written in place; a wrong shape or dtype is not
    # used (the bucket then holds a fresh tensor)
    store = torch.zeros(100, 8)
    into = {
        "a.weight": store[:7, :5],
        "c.w": torch.zeros(4, 3, 2),
        "b.weight": torch.zeros(3, 2),  # wrong shape
        "low.weight": torch.zeros(5, 6, dtype=torch.float32),  # wrong dtype (no cast here)
    }
    seen: Bucket = []
    job = RefitJob(model, 64, "v1", None)
    stream_buckets(job, None, lambda bucket, i, last: seen.extend(bucket), into)
    got = dict(seen)
    assert got["a.weight"] is into["a.weight"] and got["c.w"] is into["c.w"]
    assert got["b.weight"] is not into["b.weight"] and got["low.weight"] is not into["low.weight"]
    assert torch.count_nonzero(into["b.weight"]) == 0 and torch.count_nonzero(into["low.weight"]) == 0
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    assert torch.count_nonzero(store[7:]) == 0 and torch.count_nonzero(store[:, 5:]) == 0  # nothing outside
    dist.barrier()


def test_bucket_gather_equals_full_tensor_on_uneven_shards() -> None:
    run_distributed(_body, 3)
