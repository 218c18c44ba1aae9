"""Tensor handles for weight refit over HTTP.

Matches SGLang's `MultiprocessingSerializer`: a list of (name, tensor) is pickled with torch's ForkingPickler,
which turns CUDA tensors into CUDA-IPC handles and shared-memory CPU tensors into shared-memory handles, then
base64-encoded so it can travel in a JSON body (`serialized_named_tensors`). Nothing is copied through HTTP but
the handles; the receiver maps the same memory. The sender must keep the tensors alive until the receiver has
answered.
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import init_reductions

_SHARING_STRATEGY = "file_system"  # shm by name: works between unrelated processes (no fd passing)


def _ensure_strategy() -> None:
    init_reductions()
    if mp.get_sharing_strategy() != _SHARING_STRATEGY:
        mp.set_sharing_strategy(_SHARING_STRATEGY)


def serialize(obj: Any) -> str:
    """Pickle `obj` with tensor handles (CPU tensors are moved to shared memory) and base64-encode it."""
    from multiprocessing.reduction import ForkingPickler

    _ensure_strategy()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize(data: str | bytes) -> Any:
    """Inverse of `serialize`. Only call this on payloads from a trusted peer (it unpickles)."""
    _ensure_strategy()
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return pickle.loads(raw)


def share_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Make CPU tensors shareable (move into shared memory); CUDA tensors are shared through IPC as they are."""
    out = []
    for name, t in named_tensors:
        t = t.detach()
        if t.device.type == "cpu":
            t = t.contiguous().clone().share_memory_() if not t.is_shared() else t
        out.append((name, t))
    return out
