"""Weight refit over a torch.distributed group between trainer rank 0 and the engine (disaggregated mode).

The group is created the way SGLang creates it, so one trainer-side helper serves both engine kinds: a TCP
rendezvous at `tcp://master_address:master_port` with `world_size` members (trainer = rank 0, engine = rank
`rank_offset`), the store prefixed with `group_name`, then a process group named `group_name` on it, without
touching the default group of either process: `miles.utils.side_group.init_side_group`, which the trainer side
(`miles.refit.broadcast`) joins too.
Tensors arrive by `broadcast(src=0)`, one per name, in the order of `names`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.engines.local.weights import WeightStore
from miles.utils.side_group import init_side_group
from miles.utils.types import JSON

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,  # broadcast as its bytes (gloo has no FP8): see receive_tensors
}


def _int(body: dict[str, JSON], key: str) -> int:
    value = body[key]
    if not isinstance(value, int | float | str) or isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not an integer")
    return int(value)


@dataclass(frozen=True)
class GroupRequest:
    """The body of /init_weights_update_group (SGLang's field names)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"

    @classmethod
    def from_json(cls, body: dict[str, JSON]) -> GroupRequest:
        """ValueError naming a missing or non-integer field."""
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise ValueError(f"missing fields {missing}")
        port, rank_offset, world_size = (_int(body, k) for k in ("master_port", "rank_offset", "world_size"))
        return cls(
            str(body["master_address"]),
            port,
            rank_offset,
            world_size,
            group_name=str(body.get("group_name", "weight_update_group")),
            backend=str(body.get("backend", "gloo")),
        )


def init_update_group(request: GroupRequest, timeout_s: float = 30.0) -> dist.ProcessGroup:
    """Engine side of /init_weights_update_group (TP=1: the engine is rank `rank_offset`); gives up after
    `timeout_s` when the peers do not all join."""
    if request.backend != "gloo":
        raise ValueError(
            f"backend {request.backend!r}: the embedded engine runs on CPU and supports only 'gloo'"
        )
    return init_side_group(
        request.master_address,
        request.master_port,
        request.rank_offset,
        request.world_size,
        request.group_name,
        timeout_s=timeout_s,
    )


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} not supported; allowed: {sorted(_DTYPES)}")
    return _DTYPES[key]


def receive_tensors(
    group: dist.ProcessGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    weights: WeightStore,
) -> int:
    """Receive one broadcast per name from rank 0 and load it; names and shapes are checked before any receive."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}, {len(dtypes)}, {len(shapes)}")
    specs = [(n, parse_dtype(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]
    for n, _, s in specs:
        if not n.endswith("_scale_inv"):  # an FP8 weight's block scales (miles.refit.fp8): their own shape
            weights.validate(n, torch.empty(s, dtype=torch.float32, device="meta"))
    fp8 = any(dtype == torch.float8_e4m3fn for _, dtype, _ in specs)
    received = []
    for n, dtype, shape in specs:
        buf = torch.empty(shape, dtype=dtype, device=weights.device)
        dist.broadcast(buf.view(torch.uint8) if dtype == torch.float8_e4m3fn else buf, src=0, group=group)
        if fp8:
            received.append((n, buf))  # an FP8 weight needs its scales: the bucket loads as a whole
        else:
            weights.load_one(n, buf)
    if received:
        weights.load(received)
    return len(specs)


def destroy_update_group(group: dist.ProcessGroup) -> None:
    """Leave and free the group."""
    dist.destroy_process_group(group)
