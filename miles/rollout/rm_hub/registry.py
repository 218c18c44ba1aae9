"""Registry of reward-model types (`--rm-type`) and loading of custom reward functions (`--custom-rm-path`).

A reward function is called as `fn(ctx, sample) -> float | dict[str, float]` (or an awaitable of one), where
`ctx` is a `RewardContext` (the settings it may need) and `sample` a `miles.utils.types.Sample` whose
`response`, `label` and `metadata` are set. A dict reward names several scores; `--reward-key` picks the
trained one. With `--group-rm` a custom function is called once per prompt group as `fn(ctx, samples)` and
returns one reward per sample.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from miles.rollout.rm_hub.context import RewardContext
from miles.utils.misc import load_function
from miles.utils.types import Sample

Reward = float | dict[str, float]
RewardFn = Callable[[RewardContext, Sample], "Reward | Awaitable[Reward]"]
GroupRewardFn = Callable[[RewardContext, list[Sample]], "list[Reward] | Awaitable[list[Reward]]"]
PostProcessFn = Callable[[RewardContext, list[Sample]], list[float]]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under `name`; a name registered twice raises ValueError."""
    if not name:
        raise ValueError("reward type name must be a non-empty string")
    if name.startswith("boxed_"):
        raise ValueError(
            f"reward type {name!r}: the 'boxed_' prefix is reserved (it scores the boxed answer)"
        )

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(
                f"reward type {name!r} is already registered (by {_REGISTRY[name].__qualname__})"
            )
        _REGISTRY[name] = fn
        return fn

    return deco


def reward_types() -> list[str]:
    """Names of all registered reward types, sorted (each also usable with a `boxed_` prefix)."""
    return sorted(_REGISTRY)


def split_rm_type(rm_type: str) -> tuple[bool, str]:
    """`("boxed_math")` -> `(True, "math")`: whether the boxed answer is scored, and the base type."""
    if rm_type.startswith("boxed_"):
        return True, rm_type[len("boxed_") :]
    return False, rm_type


def get_reward_fn(rm_type: str) -> RewardFn:
    """The reward function registered as `rm_type` (without its `boxed_` prefix); ValueError listing the types."""
    try:
        return _REGISTRY[split_rm_type(rm_type)[1]]
    except KeyError:
        raise ValueError(
            f"unknown --rm-type {rm_type!r}; choose one of {reward_types()} (optionally prefixed with 'boxed_')"
        ) from None


def load_custom_rm(path: str) -> RewardFn:
    """Import the user reward function `module.path:function` given by `--custom-rm-path`.

    Raises ValueError naming the flag and the path when it cannot be imported or is not callable.
    """
    return load_function(path, "--custom-rm-path")
