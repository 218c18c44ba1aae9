"""DP ranks with very different sequence lengths agree on micro-batch counts (2-process gloo)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from tests.integration._util import run_distributed

WORLD = 2
CAP = 256  # max_tokens_per_gpu
GLOBAL_BATCH = 16  # 8 samples per rank per step; 2 steps per rank


def _lengths(rank: int) -> list[int]:
    rng = random.Random(rank)
    if rank == 0:  # short sequences: one micro-batch per step would do
        return [rng.randint(4, 20) for _ in range(16)]
    return [rng.randint(100, 250) for _ in range(16)]  # long: several micro-batches per step


def _body(rank: int, world_size: int) -> None:
    """Runs in each of WORLD gloo processes (see tests/integration/_util.py)."""
    torch.set_num_threads(1)
    from miles.backends.fsdp_utils.data_packing import (
        dist_allreduce_max,
        pack_sequences,
        plan_micro_batches,
    )
    from miles.utils.seqlen_balancing import get_minimum_num_micro_batch_size

    lengths = _lengths(rank)
    local_min = [get_minimum_num_micro_batch_size(lengths[s : s + 8], CAP) for s in (0, 8)]
    plan = plan_micro_batches(
        lengths,
        global_batch_size=GLOBAL_BATCH,
        use_dynamic=True,
        max_tokens_per_gpu=CAP,
        micro_batch_size=None,
        dp_size=WORLD,
        cp_size=1,
        allreduce_max=dist_allreduce_max(dist.group.WORLD),
    )
    counts = [len(step) for step in plan]
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, (local_min, counts))
    mins = [m for m, _ in everyone]
    assert mins[0] != mins[1], "the two ranks should need different counts on their own"
    assert everyone[0][1] == everyone[1][1], f"ranks disagree on micro-batch counts: {everyone}"
    assert counts == [max(mins[0][s], mins[1][s]) for s in range(2)]
    for s, step in enumerate(plan):
        assert sorted(i for mb in step for i in mb) == list(range(8 * s, 8 * s + 8))
        for mb in step:
            assert mb and sum(lengths[i] for i in mb) <= CAP
        # packing a step into the agreed count gives exactly that many packs, none over the cap
        samples = [{"tokens": [1] * lengths[i], "response_length": 1} for i in range(8 * s, 8 * s + 8)]
        packs = pack_sequences(samples, num_packs=counts[s], max_tokens_per_pack=CAP)
        assert len(packs) == counts[s] and all(p.num_tokens <= CAP for p in packs)
    dist.barrier()


def test_dp_ranks_agree_on_micro_batch_counts():
    run_distributed(_body, WORLD)
