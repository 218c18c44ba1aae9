"""The default whole-rollout and eval functions, written on the seams (`RolloutFn`, `EvalFn`).

`generate_rollout` (dynamic sampling with over-sampling, partial rollout):
  1. keep enough prompt groups in flight to fill the batch: whenever kept + in-flight groups are fewer than
     `--rollout-batch-size`, take `--over-sampling-batch-size` more groups: first from the partial-rollout
     buffer, then fresh prompts from the data source;
  2. each group is generated (the generate function, once per unfinished sample; an agent session's picked
     leaves all join the group, see `generate_group`) and scored as a whole; the
     requests of one group go out as one batch request, and those of all the groups taken at once as one batch
     request per engine when the rollout needs every one of them (no group filter, none beyond the batch);
  3. a finished group goes through the group filter (`--dynamic-sampling-filter-path`); a dropped group is
     counted by reason (`rollout/filtered_groups/<reason>`) and its prompt is spent;
  4. once `--rollout-batch-size` groups passed, generation stops: new requests are not sent and in-flight ones
     are aborted on every engine (`/abort_request`). With `--partial-rollout` the unfinished groups, and finished
     groups beyond the batch ("surplus"), go to the data source's buffer and are continued first by the next
     rollout (from where they stopped, with the then-current weights; each segment records its weight version;
     `--mask-offpolicy-in-partial-rollout` sets the loss mask of the earlier segments to 0). Without it they
     are discarded: their prompts are spent (`rollout/discarded_groups`).
  One rollout draws at most max(dataset size, `--over-sampling-batch-size`) fresh prompts: a filter that
  leaves the batch short by then raises, naming the filter, the rounds tried and the drop reasons.

`eval_rollout`: every prompt of each eval set, `--n-samples-per-eval-prompt` times, scored per sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Awaitable

from miles.rollout.base_types import (
    EvalOutput,
    EvalSet,
    FilterResult,
    GenerateContext,
    RolloutContext,
    RolloutOutput,
)
from miles.rollout.generate_batching import batching, batching_open
from miles.rollout.generate_client import EngineError, GenerateClient, expired_in_thread
from miles.rollout.metrics import eval_metrics
from miles.utils.progress import progress_bar
from miles.utils.types import Sample, SampleStatus


class DynamicSamplingExhausted(RuntimeError):
    """The group filter left the batch short after every prompt this rollout may draw was tried."""


def _check_generated(sample: object, name: str, index: int, phase: str) -> Sample:
    if not isinstance(sample, Sample):
        raise ValueError(
            f"{phase}: generate function {name} returned {type(sample).__name__} for sample {index}"
        )
    problem = sample.check_consistent()
    if problem:
        raise ValueError(f"{phase}: generate function {name} returned sample index {index} whose {problem}")
    if sample.status == SampleStatus.PENDING:
        raise ValueError(f"{phase}: generate function {name} left sample index {index} with status 'pending'")
    return sample


async def generate_group(ctx: RolloutContext, gen_ctx: GenerateContext, group: list[Sample]) -> list[Sample]:
    """Generate every unfinished sample of `group` in place (results checked). The group's requests go out
    together: in the batch its caller opened (`batching`: several groups), else in one of its own. A generate
    function that returns a list (an agent session's picked leaves, the episode's own first) puts all of them
    in the group, in that place: the group then holds more samples than it was drawn with."""
    results: list[list[Sample]] = [[s] for s in group]

    async def one(i: int, sample: Sample) -> None:
        if sample.is_finished:
            return
        index = sample.index
        out = await ctx.generate(ctx.client, sample, ctx.settings.sampling, gen_ctx)
        outs = out if isinstance(out, list) else [out]
        if not outs:
            raise ValueError(
                f"{gen_ctx.phase}: generate function {ctx.generate_name} returned no sample for {index}"
            )
        results[i] = [_check_generated(o, ctx.generate_name, index, gen_ctx.phase) for o in outs]

    with contextlib.nullcontext() if batching_open() else batching(object()):
        await asyncio.gather(*(one(i, s) for i, s in enumerate(group)))
    group[:] = [s for r in results for s in r]
    return group


def share_session_rewards(group: list[Sample]) -> None:
    """Give the extra samples of an agent session (`metadata["session_extra"]`, generated right after the
    episode's own sample) that sample's reward: the leaves of one session share its reward."""
    first: Sample | None = None
    for sample in group:
        if not sample.metadata.get("session_extra"):
            first = sample
        elif sample.reward is None and first is not None:
            sample.reward = dict(first.reward) if isinstance(first.reward, dict) else first.reward


async def _generate_and_score(ctx: RolloutContext, gen_ctx: GenerateContext, group: list[Sample]) -> int:
    """Generate and score one group; returns how many reward calls failed. A group cut short by the end of
    the rollout (an aborted sample after `stop_new_requests`) is left unscored. The reward function scores an
    agent session's own sample only (see `share_session_rewards`)."""
    await generate_group(ctx, gen_ctx, group)
    if ctx.client.stopped and any(s.status == SampleStatus.ABORTED for s in group):
        return 0
    failed = await ctx.scorer.score([s for s in group if not s.metadata.get("session_extra")])
    share_session_rewards(group)
    return failed


def group_verdict(ctx: RolloutContext, group: list[Sample]) -> FilterResult:
    if ctx.group_filter is None:
        return FilterResult(keep=True)
    out = ctx.group_filter(group, ctx.settings.reward_key)
    if isinstance(out, bool):
        return FilterResult(keep=out, reason=None if out else "filtered")
    if not isinstance(out, FilterResult):
        raise ValueError(
            f"group filter {ctx.filter_name} returned {type(out).__name__} for the group of sample indices "
            f"{[s.index for s in group]}; expected a FilterResult or a bool"
        )
    return FilterResult(keep=out.keep, reason=out.reason or "filtered") if not out.keep else out


async def _drain(client: GenerateClient, pending: dict[asyncio.Task, list[Sample]]) -> list[list[Sample]]:
    """Stop generation: no new requests, abort in-flight ones on every engine (repeated until all returned,
    for requests that were on their way), and return the groups of the tasks that were pending."""
    if not pending:
        return []
    client.stop_new_requests()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + client.timeout
    groups: list[list[Sample]] = []
    while pending:
        await client.abort_all("rollout abort (the batch is full)")
        done, _ = await asyncio.wait(pending, timeout=1.0)
        for task in done:
            groups.append(pending.pop(task))
            task.result()
        if pending and loop.time() > deadline:
            message = (
                f"rollout abort: {len(pending)} group(s) still generating {client.timeout:.0f}s after "
                f"/abort_request to {client.engine_urls}"
            )
            raise EngineError(await expired_in_thread(message, f"engines {client.engine_urls}"))
    return groups


async def _cancel(pending: dict[asyncio.Task, list[Sample]]) -> None:
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _prepare(ctx: RolloutContext, group: list[Sample], first_index: int, rollout_id: int) -> None:
    """Give the group's samples indices unique in this rollout (request ids derive from them) and, for groups
    continued from an earlier rollout with --mask-offpolicy-in-partial-rollout, mask their old segments."""
    s = ctx.settings
    for j, sample in enumerate(group):
        sample.index = first_index + j
        sample.metadata.setdefault("start_rollout_id", rollout_id)
        if s.partial_rollout and s.mask_offpolicy_in_partial_rollout and sample.response_length > 0:
            sample.loss_mask = [0] * sample.response_length


async def generate_rollout(ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
    """The default rollout (see the module docstring)."""
    s = ctx.settings
    target, over = s.rollout_batch_size, s.over_sampling_batch_size
    gen_ctx = dataclasses.replace(ctx.generate_ctx, request_id_prefix=f"rollout{rollout_id}")
    limit = max(len(ctx.data_source.dataset), over)
    pending: dict[asyncio.Task, list[Sample]] = {}
    kept: list[list[Sample]] = []
    surplus: list[list[Sample]] = []
    drops: Counter[str] = Counter()
    fresh = rounds = failed = next_index = 0

    def launch(groups: list[list[Sample]]) -> None:
        """Start generating and scoring `groups`. When the rollout needs every one of them (no group filter, no
        group beyond the batch), the rollout ends only once all are back: their requests share batch requests
        (one per engine); otherwise each group's go out alone, so a slow group never holds up the others."""
        nonlocal next_index
        together = ctx.group_filter is None and len(kept) + len(pending) + len(groups) <= target
        with batching(object(), per_engine=True) if together else contextlib.nullcontext():
            for group in groups:
                _prepare(ctx, group, next_index, rollout_id)
                next_index += len(group)
                task: Awaitable[int] = _generate_and_score(ctx, gen_ctx, group)
                pending[asyncio.ensure_future(task)] = group

    bar = progress_bar(target, f"rollout {rollout_id}", unit="group")
    try:
        while len(kept) < target:
            while len(kept) + len(pending) < target:
                groups = ctx.data_source.take_buffered(over)
                room = min(over - len(groups), limit - fresh)
                if room > 0:
                    groups += ctx.data_source.next_batch(room)
                    fresh += room
                if not groups:
                    break
                rounds += 1
                launch(groups)
            if not pending:
                raise DynamicSamplingExhausted(
                    f"dynamic sampling: group filter {ctx.filter_name} kept {len(kept)} of the {target} groups "
                    f"a rollout needs after {rounds} round(s) of up to {over} groups ({fresh} fresh prompts "
                    f"drawn: every prompt of the dataset once); dropped: {dict(drops)}"
                )
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = pending.pop(task)
                failed += task.result()
                verdict = group_verdict(ctx, group)
                if not verdict.keep:
                    drops[verdict.reason or "filtered"] += 1
                elif len(kept) < target:
                    kept.append(group)
                    bar.update()
                else:
                    surplus.append(group)
        leftover = await _drain(ctx.client, pending)
    except BaseException:
        await _cancel(pending)
        raise
    finally:
        bar.close()
    kept.sort(key=lambda g: g[0].index)  # draw order, whatever order they finished in
    unfinished = surplus + leftover
    metrics = {
        "rollout/filtered_groups": float(sum(drops.values())),
        **{f"rollout/filtered_groups/{reason}": float(n) for reason, n in drops.items()},
        "rollout/sampling_rounds": float(rounds),
        "rollout/fresh_prompts": float(fresh),
        "rollout/reward_failed": float(failed),
        "rollout/carried_over_samples": float(
            sum(smp.metadata["start_rollout_id"] < rollout_id for g in kept for smp in g)
        ),
    }
    if s.partial_rollout:
        ctx.data_source.add_samples(unfinished)
        metrics["rollout/buffered_groups"] = float(len(ctx.data_source.buffer))
    else:
        metrics["rollout/discarded_groups"] = float(len(unfinished))
    return RolloutOutput(groups=kept, metrics=metrics)


async def eval_rollout(ctx: RolloutContext, eval_sets: list[EvalSet], rollout_id: int) -> EvalOutput:
    """Generate `n_samples_per_prompt` responses for every prompt of every eval set and score them."""
    scorer = ctx.scorer.for_eval()
    metrics: dict[str, float] = {}
    samples: dict[str, list[Sample]] = {}
    for es in eval_sets:
        gen_ctx = dataclasses.replace(
            ctx.generate_ctx, evaluation=True, request_id_prefix=f"eval-{es.name}-{rollout_id}"
        )
        eval_ctx = dataclasses.replace(ctx, settings=dataclasses.replace(ctx.settings, sampling=es.sampling))
        groups = es.data_source.next_batch(len(es.data_source.dataset))
        for gi, group in enumerate(groups):
            for j, sample in enumerate(group):
                sample.index, sample.group_index = gi * es.n_samples_per_prompt + j, gi
        with batching(object(), per_engine=True):  # one batch request per engine for the whole set
            await asyncio.gather(*(generate_group(eval_ctx, gen_ctx, g) for g in groups))
        await asyncio.gather(*(scorer.score(g) for g in groups))
        flat = [smp for g in groups for smp in g]
        metrics.update(eval_metrics(es.name, flat, ctx.settings.reward_key))
        samples[es.name] = flat
    return EvalOutput(metrics=metrics, samples=samples)
