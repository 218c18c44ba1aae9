"""The pure parts of --fully-async (miles.rollout.async_buffer) against plain references, and its flag rules."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from miles.rollout.async_buffer import (
    ADMIT_VERSION,
    GroupBuffer,
    WorkerFailed,
    admission_room,
    group_staleness,
    oldest_version,
    stale,
)
from miles.utils.types import Sample


def _sample(versions: list[str], admitted: int | None = None) -> Sample:
    meta = {} if admitted is None else {ADMIT_VERSION: admitted}
    return Sample(weight_versions=versions, metadata=meta)


def test_oldest_version_takes_the_admission_version_and_every_segment():
    assert oldest_version(_sample(["3", "5"])) == 3
    assert oldest_version(_sample(["5"], admitted=4)) == 4  # an in-place pause reports only the last version
    assert oldest_version(_sample([], admitted=2)) == 2
    assert oldest_version(_sample(["ext-label"])) is None
    group = [_sample(["6"], admitted=6), _sample(["6", "7"], admitted=5)]
    assert group_staleness(group, 7) == 2
    assert not stale(group, 7, 2) and stale(group, 7, 1) and not stale(group, 7, None)


def _reference_room(engine_version, next_step, ahead, batch, bound, free, size):
    """Admit one group at a time while it fits in flight and its expected train step is within the bound."""
    n = 0
    while (n + 1) * size <= free:
        if bound is not None and next_step + (ahead + n) // batch - engine_version > bound:
            break
        n += 1
    return n


@pytest.mark.parametrize("bound", [None, 0, 1, 3])
def test_admission_room_equals_the_one_at_a_time_reference(bound):
    for engine_version in range(0, 4):
        for next_step in range(engine_version, engine_version + 4):
            for ahead in range(0, 13):
                for free in (0, 3, 8, 40):
                    got = admission_room(
                        engine_version=engine_version,
                        next_step=next_step,
                        ahead=ahead,
                        batch=4,
                        max_staleness=bound,
                        free_samples=free,
                        group_size=2,
                    )
                    assert got == _reference_room(engine_version, next_step, ahead, 4, bound, free, 2)


def test_bound_zero_interval_one_admits_exactly_one_batch_per_version():
    """The synchronous schedule: one batch at version k, nothing more until the refit to k + 1."""
    kw = dict(batch=4, max_staleness=0, free_samples=100, group_size=1)
    assert admission_room(engine_version=0, next_step=0, ahead=0, **kw) == 4
    assert admission_room(engine_version=0, next_step=0, ahead=4, **kw) == 0
    assert admission_room(engine_version=0, next_step=1, ahead=0, **kw) == 0  # taken, not refitted yet
    assert admission_room(engine_version=1, next_step=1, ahead=0, **kw) == 4


def test_buffer_blocks_the_producer_when_full_and_hands_out_in_order():
    buf = GroupBuffer(2)
    assert buf.put([_sample([])]) and buf.put([_sample(["1"])])
    assert not buf.put([_sample(["2"])], timeout=0.05)  # full: the producer waits (here: gives up)
    done = threading.Event()
    threading.Thread(target=lambda: (buf.put([_sample(["3"])]), done.set())).start()
    assert not done.wait(0.2)
    assert buf.take()[0].weight_versions == []
    assert done.wait(5)
    assert [buf.take()[0].weight_versions, buf.take()[0].weight_versions] == [["1"], ["3"]]
    buf.close()
    assert not buf.put([_sample([])])


def test_buffer_take_raises_the_workers_error():
    buf = GroupBuffer(1)
    buf.fail(ValueError("engine gone"))
    with pytest.raises(WorkerFailed, match="engine gone"):
        buf.take()
    with pytest.raises(WorkerFailed, match="stopped"):
        GroupBuffer(1).take(alive=lambda: False)


BASE = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "2", "--rollout-batch-size", "2",
        "--global-batch-size", "2", "--rollout-num-gpus", "1"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--max-weight-staleness", "1"], "--max-weight-staleness"),
        (["--pause-generation-mode", "abort"], "--pause-generation-mode"),
        (["--fully-async", "--colocate"], "--colocate"),
        (["--fully-async", "--partial-rollout"], "--partial-rollout"),
        (
            ["--fully-async", "--max-weight-staleness", "0", "--update-weights-interval", "2"],
            "--max-weight-staleness",
        ),
        (["--fully-async", "--pause-generation-mode", "pause"], "--pause-generation-mode"),
        (["--fully-async", "--async-unused-samples-handler", "keep"], "--async-unused-samples-handler"),
        (
            ["--fully-async", "--async-data-buffer-capacity-factor", "0.5"],
            "--async-data-buffer-capacity-factor",
        ),
    ],
)
def test_fully_async_flags_are_validated(extra, flag):
    from miles.config import ConfigError
    from miles.config.parser import parse_config

    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_config(BASE + extra)
    if isinstance(e.value, ConfigError):
        assert flag in str(e.value)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_fully_async_accepts_each_pause_mode(mode):
    from miles.config.parser import parse_config

    cfg = parse_config(
        [*BASE, "--fully-async", "--pause-generation-mode", mode, "--max-weight-staleness", "0"]
    )
    assert cfg.rollout.pause_generation_mode == mode and cfg.rollout.update_weights_interval == 1


def test_fully_async_accepts_save():
    from miles.config.parser import parse_config

    assert parse_config([*BASE, "--fully-async", "--save", "/c"]).checkpoint.save == "/c"


def _worker(capacity: int = 4):
    from types import SimpleNamespace

    from miles.rollout.async_worker import AsyncGenerationWorker, AsyncSettings

    source = SimpleNamespace(state_dict=lambda: {"epoch": 1, "offset": 3})
    settings = AsyncSettings(
        batch=2, group_size=2, max_concurrent_samples=4, capacity=capacity, max_staleness=1, retry=True
    )
    return AsyncGenerationWorker(SimpleNamespace(data_source=source), settings, start_version=5)


def test_worker_checkpoint_keeps_buffered_groups_and_restarts_in_flight_and_retried_prompts():
    """Every admitted, untrained group is saved once: buffered ones as they finished (versions kept), in-flight
    and to-be-retried ones as their fresh prompts, which start again after the resume."""
    import json

    from miles.rollout.async_worker import GROUP_KEY

    def fresh(c: int) -> list[Sample]:
        return [Sample(prompt=f"p{c}", index=j) for j in range(2)]

    def done(c: int) -> list[Sample]:
        group = fresh(c)
        for s in group:
            s.response, s.weight_versions = "r", ["4", "5"]
            s.metadata.update({GROUP_KEY: c, ADMIT_VERSION: 4})
        return group

    old = _worker()
    old.admitted = 9
    old.fresh = {c: fresh(c) for c in (5, 6, 7, 8)}  # 5, 7 buffered; 6, 8 in flight
    for c in (7, 5):  # finished out of admission order
        old.buffer.put(done(c))
    old.retry.append(fresh(2))
    old.counts["continued_samples"] = 3
    state = json.loads(json.dumps(old.state_dict()))  # what the checkpoint stores
    assert state["data_source"] == {"epoch": 1, "offset": 3} and state["admitted"] == 9

    new = _worker()
    state.pop("data_source")
    new.load_state_dict(state)
    assert new.admitted == 9
    buffered = new.buffer.snapshot()
    assert [g[0].metadata[GROUP_KEY] for g in buffered] == [7, 5]
    assert all(
        s.weight_versions == ["4", "5"] and s.metadata[ADMIT_VERSION] == 4 for g in buffered for s in g
    )
    assert sorted(new.fresh) == [5, 7] and new.fresh[5][0].prompt == "p5" and new.fresh[5][0].response == ""
    assert [g[0].prompt for g in new.retry] == ["p2", "p6", "p8"]  # retries first, then in flight in order
    assert new.counts == {"continued_samples": 3, "resumed_groups": 3}
    with pytest.raises(ValueError, match="capacity 1"):
        _worker(capacity=1).load_state_dict(state)


def test_the_synchronous_driver_refuses_fully_async(capsys):
    from miles.train import main

    assert main([*BASE, "--fully-async"]) == 2
    assert "miles.train_async" in capsys.readouterr().err


def test_each_weight_version_span_is_recorded_as_a_segment():
    """A request held across a refit (in_place or retract pause) answers with two spans: both versions are
    recorded, so its staleness counts its oldest token; without spans the answer's weight_version is."""
    from miles.rollout.async_buffer import oldest_version
    from miles.rollout.generate import apply_output
    from miles.rollout.generate_output import GenerateOutput

    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    body = {"output_ids": [1, 2, 3, 4, 5], "meta_info": {"weight_version": "4", "weight_versions": spans}}
    sample = Sample(tokens=[7, 8])
    apply_output(sample, GenerateOutput.from_response(body, "test"))
    assert sample.weight_versions == ["3", "4"] and oldest_version(sample) == 3
    plain = Sample(tokens=[7, 8])
    apply_output(
        plain, GenerateOutput.from_response({"output_ids": [1], "meta_info": {"weight_version": "4"}}, "t")
    )
    assert plain.weight_versions == ["4"]
    empty = {
        "output_ids": [],
        "meta_info": {"weight_version": "4", "weight_versions": [spans[1] | {"start": 5}]},
    }
    aborted = Sample(tokens=[7, 8])
    apply_output(aborted, GenerateOutput.from_response(empty | {"meta_info": empty["meta_info"] | {
        "finish_reason": {"type": "abort"}}}, "t"))  # fmt: skip
    assert aborted.weight_versions == []


def test_a_fully_async_checkpoint_with_pending_groups_is_refused_by_the_other_drivers():
    """miles.train (or the one-step-off driver) would resume only the data cursor of a --fully-async checkpoint and
    skip its buffered and in-flight prompts: refused, naming the flag; with nothing pending it resumes."""
    from types import SimpleNamespace

    from miles.ray.rollout_manager import RolloutManager

    loaded = []
    manager = SimpleNamespace(
        rollout_cfg=SimpleNamespace(fully_async=False), runner=SimpleNamespace(load_state_dict=loaded.append)
    )
    pending = {"data_source": {}, "buffer": [], "async_worker": {"buffered": [[{}]], "restart": [[{}]]}}
    with pytest.raises(RuntimeError, match="2 prompt group.*--fully-async"):
        RolloutManager.load_state_dict(manager, pending)  # type: ignore[arg-type]
    assert loaded == []
    idle = {"data_source": {}, "buffer": [], "async_worker": {"buffered": [], "restart": []}}
    RolloutManager.load_state_dict(manager, idle)  # type: ignore[arg-type]
    assert loaded == [idle]
    manager.rollout_cfg.fully_async = True
    RolloutManager.load_state_dict(manager, pending)  # type: ignore[arg-type]
    assert manager.async_state == pending["async_worker"]


def test_take_batch_reports_counts_of_zero():
    """Counts that stayed 0 this step (nothing dropped, buffered or in flight) are reported as 0, not left out
    of metrics.jsonl."""
    from miles.rollout.async_worker import GROUP_KEY

    worker = _worker()
    for c in (0, 1):
        group = [
            Sample(prompt=f"p{c}", index=j, weight_versions=["5"], metadata={GROUP_KEY: c}) for j in range(2)
        ]
        worker.fresh[c] = group
        worker.buffer.put(group)
    worker.counts["reward_failed"] += 0
    kept, metrics = worker.take_batch(5, timeout=1)
    assert [g[0].metadata[GROUP_KEY] for g in kept] == [0, 1]
    for key in ("dropped_groups", "retried_groups", "discarded_tokens", "continued_samples", "resumed_groups",
                "reward_failed", "buffered_groups", "in_flight_groups"):  # fmt: skip
        assert metrics[f"async/{key}"] == 0.0, key
    assert metrics["async/engine_version"] == 5.0 and metrics["async/staleness_max"] == 0.0


def test_take_batch_counts_the_tokens_of_groups_beyond_the_bound():
    """A group staler than --max-weight-staleness is not trained: its response tokens are counted in
    async/discarded_tokens (with the retried group), the kept groups' are not."""
    from miles.rollout.async_worker import GROUP_KEY

    worker = _worker()  # bound 1, batch 2, retry
    for c, version, length in ((0, "3", 7), (1, "5", 4), (2, "4", 9)):  # trained at step 5: staleness 2, 0, 1
        group = [
            Sample(prompt=f"p{c}", index=j, weight_versions=[version], response_length=length + j,
                   metadata={GROUP_KEY: c})
            for j in range(2)
        ]  # fmt: skip
        worker.fresh[c] = group
        worker.buffer.put(group)
    kept, metrics = worker.take_batch(5, timeout=1)
    assert [g[0].metadata[GROUP_KEY] for g in kept] == [1, 2]
    assert metrics["async/discarded_tokens"] == 7 + 8
    assert metrics["async/retried_groups"] == 1.0 and metrics["async/dropped_groups"] == 0.0
    assert [g[0].prompt for g in worker.retry] == ["p0"]


@pytest.mark.parametrize(("bound", "shared"), [(0, True), (1, False), (None, False)])
def test_groups_share_a_batch_request_only_with_bound_zero(bound, shared):
    """An engine answers a batch request once all its items are done. With bound 0 the groups started together
    are one version's batch, trained together, so they share one (as miles.train sends them: the same requests);
    otherwise each group goes alone, so a long response holds up only its own group's slots."""
    import asyncio

    from miles.rollout.async_worker import AsyncGenerationWorker, AsyncSettings
    from miles.rollout.generate_batching import current_batch

    settings = AsyncSettings(
        batch=2, group_size=2, max_concurrent_samples=4, capacity=4, max_staleness=bound, retry=True
    )
    worker = AsyncGenerationWorker(SimpleNamespace(), settings, start_version=0)
    seen = []

    async def run_group(ctx, group):
        seen.append(current_batch())

    worker._run_group = run_group

    async def main():
        worker._wake_event = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        worker._launch(None, [[Sample(prompt="a")], [Sample(prompt="b")]], tasks)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    if shared:
        assert seen[0] is not None and seen[0] is seen[1] and seen[0].per_engine
    else:
        assert seen == [None, None]  # generate_group then opens one batch per group


def test_a_finished_group_goes_straight_into_a_buffer_with_room_and_waits_when_it_is_full(monkeypatch):
    """`_run_group` puts a finished group without a thread hop while the buffer has room, and waits (off the
    event loop) for room when it is full: both groups arrive, in order, and nothing is left waiting."""
    import asyncio
    import dataclasses
    import threading

    from miles.rollout import async_worker as aw

    @dataclasses.dataclass(frozen=True)
    class GenCtx:
        request_id_prefix: str = ""

    async def generate_group(ctx, gen_ctx, group):
        return group

    async def score(group):
        return 0

    monkeypatch.setattr(aw, "generate_group", generate_group)
    monkeypatch.setattr(aw, "group_verdict", lambda ctx, group: SimpleNamespace(keep=True, reason=None))
    settings = aw.AsyncSettings(
        batch=1, group_size=1, max_concurrent_samples=2, capacity=1, max_staleness=None, retry=False
    )
    worker = aw.AsyncGenerationWorker(SimpleNamespace(), settings, start_version=0)
    ctx = SimpleNamespace(generate_ctx=GenCtx(), scorer=SimpleNamespace(score=score))
    groups = [
        [Sample(prompt=p, metadata={"start_rollout_id": 0, aw.GROUP_KEY: i})] for i, p in enumerate("ab")
    ]
    taken = []

    async def main():
        worker._resumed = asyncio.Event()
        worker._resumed.set()
        worker.in_flight = 2
        await worker._run_group(ctx, groups[0])  # room: put at once
        assert len(worker.buffer) == 1 and worker.waiting_put == 0
        second = asyncio.ensure_future(worker._run_group(ctx, groups[1]))
        await asyncio.sleep(0.2)
        assert not second.done() and worker.waiting_put == 1  # full: waits for the trainer's take
        taker = threading.Thread(target=lambda: taken.append(worker.buffer.take(5.0)))
        taker.start()
        await asyncio.wait_for(second, 5.0)
        taker.join()

    asyncio.run(main())
    assert taken == [groups[0]] and worker.buffer.snapshot() == [groups[1]]
    assert worker.waiting_put == 0 and worker.in_flight == 0
