"""Scoring a batch of samples with a registered reward type or a custom reward function."""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any

from miles.rollout.rm_hub.registry import RewardFn, get_reward_fn, load_custom_rm
from miles.utils.types import Sample, SampleStatus


def resolve_reward_fn(rm_type: str | None, custom_rm_path: str | None) -> tuple[RewardFn, str]:
    """The reward function to use and a name for error messages; `custom_rm_path` wins over `rm_type`."""
    if custom_rm_path:
        return load_custom_rm(custom_rm_path), f"--custom-rm-path={custom_rm_path}"
    if rm_type:
        return get_reward_fn(rm_type), f"--rm-type={rm_type}"
    raise ValueError("no reward function: set --rm-type or --custom-rm-path")


def _as_reward(value: Any, fn_name: str, sample: Sample) -> float:
    if isinstance(value, bool | int):
        return float(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(
        f"reward function {fn_name} returned {value!r} ({type(value).__name__}) "
        f"for sample index {sample.index}; expected a finite float (bool/int are accepted)"
    )


async def _call(fn: RewardFn, args: Any, sample: Sample) -> Any:
    out = fn(args, sample)
    if inspect.isawaitable(out):
        out = await out
    return out


async def score_samples(
    samples: list[Sample],
    rm_type: str | None,
    custom_rm_path: str | None,
    args: Any,
    error_as_zero: bool,
) -> tuple[list[float], int]:
    """Score `samples` concurrently; returns (one float per sample, number of samples whose scoring failed).

    The reward function is `custom_rm_path` when given, else the registered `rm_type`; it is called as
    `fn(args, sample)`, sync or async. A function that raises makes this raise RuntimeError naming the
    function and the sample index (the original exception chained) unless `error_as_zero`, in which case
    that sample scores 0.0, its status becomes `SampleStatus.FAILED`, and it is counted. A return value that
    is not a finite float (bool/int are coerced) is a bug in the function and always raises ValueError.
    Samples' `reward` fields are left to the caller.
    """
    fn, fn_name = resolve_reward_fn(rm_type, custom_rm_path)
    results = await asyncio.gather(*(_call(fn, args, s) for s in samples), return_exceptions=True)
    scores: list[float] = []
    n_failed = 0
    for sample, result in zip(samples, results):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):  # KeyboardInterrupt, CancelledError, ...
                raise result
            if not error_as_zero:
                raise RuntimeError(
                    f"reward function {fn_name} failed on sample index {sample.index}: "
                    f"{type(result).__name__}: {result}"
                ) from result
            sample.status = SampleStatus.FAILED
            n_failed += 1
            scores.append(0.0)
            continue
        scores.append(_as_reward(result, fn_name, sample))
    return scores, n_failed
