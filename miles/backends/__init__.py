"""Training backend registry: `--train-backend NAME` -> the class of each role, imported lazily.

The registry itself imports nothing heavy, so configuration parsing can list the choices without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.backends.base import PolicyBackend, ValueBackend

# name -> role -> "module:ClassName" of the backend's plain class for that role (see miles/backends/base.py):
# every backend has an "actor" (a `PolicyBackend`); one with a "critic" (a `ValueBackend`) supports
# --advantage-estimator ppo
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
    from miles.utils.transformers_import import lean_transformers

    with lean_transformers():  # transformers' model code without scipy.optimize (~0.5 s of CPU per rank)
        return getattr(importlib.import_module(module_name), cls_name)


def get_policy_class(name: str) -> type[PolicyBackend]:
    """The 'actor' role's class of backend `name`."""
    from miles.backends.base import PolicyBackend

    cls = get_backend_class(name, "actor")
    if not issubclass(cls, PolicyBackend):
        raise TypeError(f"--train-backend {name!r}: the actor {cls.__qualname__} is not a PolicyBackend")
    return cls


def get_value_class(name: str) -> type[ValueBackend]:
    """The 'critic' role's class of backend `name`."""
    from miles.backends.base import ValueBackend

    cls = get_backend_class(name, "critic")
    if not issubclass(cls, ValueBackend):
        raise TypeError(f"--train-backend {name!r}: the critic {cls.__qualname__} is not a ValueBackend")
    return cls
