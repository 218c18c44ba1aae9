"""Move an FSDP2 model's sharded parameters (and grads) and its optimizer state off the accelerator and back.

Used by colocated mode: `offload_to_cpu` before the rollout engines wake up, `load_to_device` before training.
FSDP2 modules support ``module.to(device)``: it reshards first, moves each parameter's local shard (the DTensor
keeps its identity, so the optimizer's per-parameter state stays keyed correctly) and refreshes FSDP's view of
the sharded storage. On a CPU-only run (or with CPUOffloadPolicy, where shards already live on CPU) both calls
are no-ops; that is logged once per process.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)
_logged_noop = False


def _log_noop_once(where: str) -> None:
    global _logged_noop
    if not _logged_noop:
        logger.info("%s: parameters already on CPU; offload/onload are no-ops in this process", where)
        _logged_noop = True


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise ValueError(f"{type(model).__name__} has no parameters to move")


def _move_optimizer_state(optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            # "step" is a CPU scalar tensor for AdamW unless capturable/fused; keep it where it is.
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)


@torch.no_grad()
def offload_to_cpu(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Move parameter shards, their grads and the optimizer state to CPU, then release cached GPU memory."""
    if _param_device(model).type == "cpu":
        _log_noop_once("offload_to_cpu")
        return
    model.to("cpu")  # FSDPModule._apply: moves the local shards (and .grad) and re-registers them
    _move_optimizer_state(optimizer, torch.device("cpu"))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@torch.no_grad()
def load_to_device(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device | str
) -> None:
    """Inverse of `offload_to_cpu`: bring the shards, grads and optimizer state back onto ``device``."""
    device = torch.device(device)
    if device.type == "cpu":
        _log_noop_once("load_to_device")
        return
    if _param_device(model) == device:
        return
    model.to(device)
    _move_optimizer_state(optimizer, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
