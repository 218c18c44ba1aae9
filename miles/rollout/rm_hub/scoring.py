"""`RewardScorer`: scores samples with the configured reward function and sets the trained scalar.

Which function scores a sample: `--custom-rm-path` when given (called per sample, or once per prompt group with
`--group-rm`), else the built-in type named by the sample's `metadata["rm_type"]`, else `--rm-type` (with
`--rm-url` and no type: `remote_rm`). After the batch is chosen, `set_train_rewards` sets each sample's
`train_reward`: `--custom-reward-post-process-path` when given (`fn(ctx, samples) -> list[float]`), else the
reward itself (`reward[--reward-key]` for a dict reward).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
from collections.abc import Awaitable, Callable

from miles.rollout.rm_hub.context import RewardContext
from miles.rollout.rm_hub.math_utils import last_boxed_content
from miles.rollout.rm_hub.registry import (
    GroupRewardFn,
    PostProcessFn,
    Reward,
    RewardFn,
    get_reward_fn,
    load_custom_rm,
    split_rm_type,
)
from miles.utils.deadline import DeadlineExceeded, call_each_with_deadline, call_with_deadline
from miles.utils.misc import load_function
from miles.utils.types import Sample, SampleStatus


def _number(value: object) -> float | None:
    if isinstance(value, bool | int):
        return float(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def check_reward(value: object, fn_name: str, sample: Sample) -> Reward:
    """`value` as a reward: a finite float (bool/int coerced) or a non-empty dict of them; ValueError otherwise."""
    number = _number(value)
    if number is not None:
        return number
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        numbers = {k: _number(v) for k, v in value.items()}
        if all(v is not None for v in numbers.values()):
            return numbers  # type: ignore[return-value]
    raise ValueError(
        f"reward function {fn_name} returned {value!r} ({type(value).__name__}) for sample index "
        f"{sample.index}; expected a finite float (bool/int are accepted) or a dict of them"
    )


async def _maybe_await(value: Reward | Awaitable[Reward]) -> Reward:
    return await value if inspect.isawaitable(value) else value


def resolve_builtin(ctx: RewardContext, sample: Sample) -> tuple[RewardFn, Sample, str]:
    """The built-in function for `sample` (its `metadata["rm_type"]`, else `ctx.rm_type`), the view of the
    sample it scores (the last \\boxed{} content for a `boxed_` type) and the function's name for messages."""
    rm_type = sample.metadata.get("rm_type") or ctx.rm_type
    if not rm_type:
        raise ValueError(
            f"no reward function for sample index {sample.index}: set --rm-type, --custom-rm-path or --rm-url, "
            'or give the sample a metadata["rm_type"]'
        )
    boxed, _ = split_rm_type(str(rm_type))
    fn = get_reward_fn(str(rm_type))
    view = (
        dataclasses.replace(sample, response=last_boxed_content(sample.response) or "") if boxed else sample
    )
    return fn, view, f"rm_type {rm_type}"


async def builtin_reward(ctx: RewardContext, sample: Sample) -> Reward:
    """Score with the built-in type of `sample.metadata["rm_type"]` or `ctx.rm_type` (`boxed_` prefix honoured)."""
    fn, view, _ = resolve_builtin(ctx, sample)
    return await _maybe_await(fn(ctx, view))


class RewardScorer:
    """Scores samples in place. Built once per run; loading a function by path fails here, naming the flag."""

    def __init__(
        self,
        ctx: RewardContext,
        custom_rm_path: str | None = None,
        group_rm: bool = False,
        error_as_zero: bool = False,
        post_process_path: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        """`timeout`: seconds one reward function call may take (--reward-timeout); sync functions run in a
        thread meanwhile, a group's calls in turn in one thread unless they are slow (see
        `miles.utils.deadline.call_each_with_deadline`), so the event loop keeps serving other samples."""
        if timeout <= 0:
            raise ValueError(f"--reward-timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        self.ctx = ctx
        self.group_rm = group_rm
        self.error_as_zero = error_as_zero
        self.custom: RewardFn | GroupRewardFn | None = (
            load_custom_rm(custom_rm_path) if custom_rm_path else None
        )
        self.fn_name = f"--custom-rm-path={custom_rm_path}" if custom_rm_path else f"--rm-type={ctx.rm_type}"
        if self.custom is None and ctx.rm_type:
            get_reward_fn(ctx.rm_type)  # an unknown type fails now, listing the known ones
        self.post_process: PostProcessFn | None = (
            load_function(post_process_path, "--custom-reward-post-process-path")
            if post_process_path
            else None
        )
        self.post_process_name = f"--custom-reward-post-process-path={post_process_path}"

    def for_eval(self) -> RewardScorer:
        """The same scorer with `ctx.evaluation` set."""
        other = object.__new__(RewardScorer)
        other.__dict__.update(self.__dict__)
        other.ctx = dataclasses.replace(self.ctx, evaluation=True)
        return other

    async def score(self, samples: list[Sample]) -> int:
        """Score every sample without a reward; `samples` is one prompt group with --group-rm. Returns how
        many failed.

        A function that raises makes this raise RuntimeError naming the function and the sample index, unless
        `error_as_zero`: then the sample scores 0.0, its status becomes FAILED, and it is counted.
        """
        todo = [s for s in samples if s.reward is None]
        if not todo:
            return 0
        if self.group_rm and self.custom is not None:
            return await self._score_as_group(todo)
        results = await self._score_each(todo)
        failed = 0
        for sample, result in zip(todo, results):
            failed += self._store(sample, result)
        return failed

    def _late(self, fn_name: str, what: str) -> str:
        return (
            f"reward function {fn_name} gave no answer within {self.timeout:g}s (--reward-timeout) for "
            f"{what} (phase: {'eval ' if self.ctx.evaluation else ''}reward)"
        )

    async def _score_each(self, samples: list[Sample]) -> list[object]:
        """What the reward function returned for each sample, or the exception it raised (checked by _store).
        The calls of one function go out as one batch (`call_each_with_deadline`: each call bounded by
        --reward-timeout from its own start)."""
        outcomes: list[object] = [None] * len(samples)
        batches: dict[Callable[..., object], list[tuple[int, tuple[object, ...], str]]] = {}
        for i, sample in enumerate(samples):
            what = f"sample index {sample.index}"
            if self.custom is not None:
                batches.setdefault(self.custom, []).append(
                    (i, (self.ctx, sample), self._late(self.fn_name, what))
                )
                continue
            try:
                fn, view, name = resolve_builtin(self.ctx, sample)
            except Exception as e:  # noqa: BLE001 - this sample's failure, reported by _store
                outcomes[i] = e
                continue
            batches.setdefault(fn, []).append((i, (self.ctx, view), self._late(name, what)))

        async def run(fn: Callable[..., object], calls: list[tuple[int, tuple[object, ...], str]]) -> None:
            got = await call_each_with_deadline(
                fn, [args for _, args, _ in calls], timeout=self.timeout, what=lambda k: calls[k][2]
            )
            for (i, _, _), out in zip(calls, got):
                outcomes[i] = out

        await asyncio.gather(*(run(fn, calls) for fn, calls in batches.items()))
        return outcomes

    async def _score_as_group(self, group: list[Sample]) -> int:
        assert self.custom is not None  # --group-rm scores with --custom-rm-path only
        late = self._late(self.fn_name, f"the group of sample indices {[s.index for s in group]}")
        try:
            rewards = await call_with_deadline(self.custom, self.ctx, group, timeout=self.timeout, what=late)
        except Exception as e:  # noqa: BLE001 - reported with the function and the group
            return sum(self._store(s, e) for s in group)
        if not isinstance(rewards, list) or len(rewards) != len(group):
            raise ValueError(
                f"--group-rm reward function {self.fn_name} returned {type(rewards).__name__} "
                f"of length {len(rewards) if isinstance(rewards, list) else '-'} for a group of {len(group)} "
                f"samples (indices {[s.index for s in group]}); expected a list with one reward per sample"
            )
        return sum(self._store(s, r) for s, r in zip(group, rewards))

    def _store(self, sample: Sample, result: object) -> int:
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):  # KeyboardInterrupt, CancelledError, ...
                raise result
            if not self.error_as_zero:
                if isinstance(result, DeadlineExceeded):  # its message names the function and the sample
                    raise result
                raise RuntimeError(
                    f"reward function {self.fn_name} failed on sample index {sample.index} (phase: reward): "
                    f"{type(result).__name__}: {result}"
                ) from result
            sample.status = SampleStatus.FAILED
            sample.reward = 0.0
            return 1
        sample.reward = check_reward(result, self.fn_name, sample)
        return 0

    def _name_for(self, sample: Sample) -> str:
        """The flag and value of the function that scored `sample` (a per-sample rm_type wins over --rm-type)."""
        if self.custom is None and sample.metadata.get("rm_type"):
            return f"rm_type {sample.metadata['rm_type']} (the sample's metadata)"
        return self.fn_name

    def set_train_rewards(self, samples: list[Sample]) -> None:
        """Set every sample's `train_reward`: the post-processing function's output, or the reward value."""
        if self.post_process is None:
            for s in samples:
                try:
                    s.train_reward = s.reward_value(self.ctx.reward_key)
                except ValueError as e:  # a dict reward without (or without the) --reward-key
                    raise ValueError(f"reward function {self._name_for(s)}: {e}") from None
            return
        values = self.post_process(self.ctx, samples)
        if not isinstance(values, list) or len(values) != len(samples):
            raise ValueError(
                f"{self.post_process_name} returned {type(values).__name__} for {len(samples)} samples; "
                "expected a list with one float per sample"
            )
        for s, v in zip(samples, values):
            value = check_reward(v, self.post_process_name, s)
            if isinstance(value, dict):
                raise ValueError(
                    f"{self.post_process_name} returned a dict for sample index {s.index}; expected a float"
                )
            s.train_reward = value


async def score_samples(
    samples: list[Sample],
    rm_type: str | None,
    custom_rm_path: str | None,
    ctx: RewardContext | None = None,
    error_as_zero: bool = False,
) -> tuple[list[Reward | None], int]:
    """Score `samples` in place (a one-off `RewardScorer`); returns (their rewards, how many failed)."""
    ctx = ctx if ctx is not None else RewardContext(rm_type=rm_type)
    if rm_type is not None and ctx.rm_type != rm_type:
        ctx = dataclasses.replace(ctx, rm_type=rm_type)
    scorer = RewardScorer(ctx, custom_rm_path, error_as_zero=error_as_zero)
    failed = await scorer.score(samples)
    return [s.reward for s in samples], failed
