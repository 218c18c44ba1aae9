"""Parallel state for the FSDP2 backend: one (dp, cp) device mesh, or (dp, cp, tp) with tensor parallelism, built once
per process.

Layout: ranks are laid out row-major on a ``(dp, cp)`` mesh, so the ``cp`` ranks of one data-parallel replica
are consecutive (rank = dp_rank * cp_size + cp_rank). FSDP2 shards parameters over *all* ranks (the flattened
``dp_cp`` mesh, exposed as ``ParallelState.fsdp_mesh``): context-parallel ranks see different token chunks of
the same sequences, so their gradient contributions must be reduced together with the data-parallel ones.

Tensor parallelism (``tp_size > 1``, issue 28) adds the innermost ``tp`` dimension: the ``tp`` ranks of one replica
are consecutive and hold slices of the attention and MLP projections (`tensor_parallel.apply_tensor_parallel`); FSDP2
shards over the data-parallel ranks only (``fsdp_mesh`` stays ``dp`` / ``dp_cp``), the TP ranks see the same samples.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from miles.utils.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class ParallelState:
    """Everything a training rank needs to know about its place in the job. Built by `init_distributed`."""

    dims: ParallelDims
    rank: int
    device: torch.device
    mesh: DeviceMesh  # 2-D, dims ("dp", "cp"); 3-D ("dp", "cp", "tp") when tp_size > 1
    fsdp_mesh: DeviceMesh  # 1-D over the data-parallel ranks ("dp_cp" flattened, or "dp" when cp_size == 1)

    @property
    def tp_size(self) -> int:
        return self.dims.tp_size

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D ``tp`` mesh of this rank's replica; None without tensor parallelism."""
        return self.mesh["tp"] if self.dims.tp_size > 1 else None

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp") if self.dims.tp_size > 1 else 0

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def cp_size(self) -> int:
        return self.dims.cp_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Ranks holding the same cp position in different replicas (size dp_size)."""
        return self.mesh.get_group("dp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """Ranks that split the same sequences (size cp_size)."""
        return self.mesh.get_group("cp")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in _BACKENDS:
        raise ValueError(
            f"distributed backend {backend!r} is not supported; allowed: {_BACKENDS} or None (auto)"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("distributed backend 'nccl' needs CUDA, but no CUDA device is available; use 'gloo'")
    return backend


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(
    backend: str | None = None, timeout_s: float = 1800.0, cp_size: int = 1, tp_size: int = 1
) -> ParallelState:
    """Join the process group described by the environment and build the (dp, cp) mesh ((dp, cp, tp) when
    ``tp_size > 1``).

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on CUDA). ``backend`` None picks nccl when
    CUDA is available, gloo otherwise. If a default process group already exists it is reused.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s}: must be > 0")
    missing = [v for v in _ENV_VARS if v not in os.environ]
    if missing and not dist.is_initialized():
        raise ValueError(f"init_distributed: environment variables {missing} are not set (need {_ENV_VARS})")
    backend = _resolve_backend(backend)
    device = _device_for(backend)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    dims = ParallelDims(world_size=dist.get_world_size(), cp_size=cp_size, tp_size=tp_size)
    if tp_size == 1:
        mesh = init_device_mesh(device.type, (dims.dp_size, dims.cp_size), mesh_dim_names=("dp", "cp"))
    else:
        shape = (dims.dp_size, dims.cp_size, tp_size)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "cp", "tp"))
    fsdp_mesh = mesh["dp"] if dims.cp_size == 1 else mesh["dp", "cp"]._flatten("dp_cp")
    state = ParallelState(dims=dims, rank=dist.get_rank(), device=device, mesh=mesh, fsdp_mesh=fsdp_mesh)
    logger.info(
        "rank %d/%d: dp %d/%d cp %d/%d tp %d/%d on %s (%s)",
        state.rank,
        dims.world_size,
        state.dp_rank,
        dims.dp_size,
        state.cp_rank,
        dims.cp_size,
        state.tp_rank,
        dims.tp_size,
        device,
        backend,
    )
    return state
