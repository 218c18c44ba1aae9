"""The side process group of the broadcast refit: trainer rank 0 plus every engine rank, beside (not inside) the
default group of either process.

Both sides join it with `init_side_group`: the trainer (`miles.refit.broadcast`, as rank 0)
and the embedded engine's `/init_weights_update_group` (`miles.engines.local.dist_update`, as rank
`rank_offset`). It is built the way SGLang's engine side builds it (`init_custom_process_group`), so an SGLang
engine joins the same group: a TCP rendezvous at `tcp://master_address:master_port` hosted by rank 0 with
`world_size` members, the store's keys prefixed with `group_name`, then a process group named `group_name` on
that store.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

SIDE_GROUP_BACKENDS = ("gloo", "nccl")


def init_side_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join the side group as `rank` of `world_size`; blocks until every member has joined (at most
    `timeout_s`). ValueError for a backend other than gloo/nccl or a rank outside the group."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if backend not in SIDE_GROUP_BACKENDS:
        raise ValueError(
            f"side group {group_name!r}: backend {backend!r} not supported; allowed: 'gloo', 'nccl'"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"side group {group_name!r}: rank {rank} outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)  # as SGLang does: keys live under the group name
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
