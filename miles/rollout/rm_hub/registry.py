"""Registry of reward-model types (`--rm-type`) and loading of custom reward functions (`--custom-rm-path`).

A reward function is called as `fn(args, sample) -> float` (or an awaitable resolving to a float), where
`args` is the run configuration (built-in types ignore it) and `sample` a `miles.utils.types.Sample` whose
`response` and `label` are set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from miles.utils.misc import load_function
from miles.utils.types import Sample

RewardFn = Callable[[Any, Sample], "float | Awaitable[float]"]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under `name`; a name registered twice raises ValueError."""
    if not name:
        raise ValueError("reward type name must be a non-empty string")

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(
                f"reward type {name!r} is already registered (by {_REGISTRY[name].__qualname__})"
            )
        _REGISTRY[name] = fn
        return fn

    return deco


def reward_types() -> list[str]:
    """Names of all registered reward types, sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(rm_type: str) -> RewardFn:
    """The reward function registered as `rm_type`; ValueError listing the registered types otherwise."""
    try:
        return _REGISTRY[rm_type]
    except KeyError:
        raise ValueError(f"unknown --rm-type {rm_type!r}; choose one of {reward_types()}") from None


def load_custom_rm(path: str) -> RewardFn:
    """Import the user reward function `module.path:function` given by `--custom-rm-path`.

    Raises ValueError naming the flag and the path when it cannot be imported or is not callable.
    """
    return load_function(path, "--custom-rm-path")
