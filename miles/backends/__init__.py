"""Training backend registry: `--train-backend NAME` -> actor class, imported lazily.

The registry itself imports nothing heavy, so configuration parsing can list the choices without torch.
"""

from __future__ import annotations

import importlib

# name -> "module:ClassName" of the backend's plain trainer class (see miles/backends/base.py)
_BACKENDS: dict[str, str] = {
    "fsdp": "miles.backends.fsdp_utils.actor:FSDPTrainer",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, target: str) -> None:
    """Register `module:Class` under `name`; duplicate names are rejected."""
    if name in _BACKENDS:
        raise ValueError(f"train backend {name!r} is already registered ({_BACKENDS[name]})")
    _BACKENDS[name] = target


def get_backend_class(name: str) -> type:
    if name not in _BACKENDS:
        raise ValueError(f"--train-backend {name!r} is not registered; choices: {available_backends()}")
    module_name, _, cls_name = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
