"""Training backend registry: `--train-backend NAME` -> actor class, imported lazily.

The registry itself imports nothing heavy, so configuration parsing can list the choices without torch.
"""

from __future__ import annotations

import importlib

# name -> role -> "module:ClassName" of the backend's plain trainer class (see miles/backends/base.py); every
# backend has an "actor"; one with a "critic" supports --advantage-estimator ppo
_BACKENDS: dict[str, dict[str, str]] = {
    "fsdp": {
        "actor": "miles.backends.fsdp_utils.actor:FSDPTrainer",
        "critic": "miles.backends.fsdp_utils.critic:FSDPCritic",
    },
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, target: str, critic_target: str | None = None) -> None:
    """Register `module:Class` (the actor) and optionally the critic's class under `name`; duplicate names are
    rejected."""
    if name in _BACKENDS:
        raise ValueError(f"train backend {name!r} is already registered ({_BACKENDS[name]})")
    _BACKENDS[name] = {"actor": target, **({"critic": critic_target} if critic_target else {})}


def get_backend_class(name: str, role: str = "actor") -> type:
    if name not in _BACKENDS:
        raise ValueError(f"--train-backend {name!r} is not registered; choices: {available_backends()}")
    if role not in _BACKENDS[name]:
        raise ValueError(f"--train-backend {name!r} has no {role!r} role (has: {sorted(_BACKENDS[name])})")
    module_name, _, cls_name = _BACKENDS[name][role].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
