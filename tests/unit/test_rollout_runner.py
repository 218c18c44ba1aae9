"""The rollout runner without Ray or servers: default rollout, DAPO dynamic sampling, partial rollout, bad input.

The engine is `tests.fake_engine.FakeEngine` on an in-process transport. Prompts come from the toy "echo" task
(label = the repeated digit); the tiny tokenizer encodes digit d as token id 4 + d.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections import Counter

import httpx
import pytest

from miles.config import parse_config
from miles.rollout.default_rollout import DynamicSamplingExhausted
from miles.rollout.generate_output import request_seed
from miles.rollout.runner import RolloutRunner
from miles.utils.types import Sample, SampleStatus
from tests.fake_engine import FakeEngine, Reply, log_prob_of

N_PROMPTS = 24


def digit(d: int) -> int:
    return 4 + d


@pytest.fixture(scope="module")
def tokenizer():
    from miles.tools.tiny_model import build_tokenizer

    return build_tokenizer("echo")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from miles.tools.toy_data import make_rows, write_jsonl

    rows = make_rows("echo", N_PROMPTS, seed=0)
    for i, row in enumerate(rows):
        row["metadata"] = {"pid": i}
    return str(write_jsonl(rows, tmp_path_factory.mktemp("data") / "echo.jsonl"))


def make_runner(tokenizer, data, engine: FakeEngine, extra: str = "", dump_dir=None) -> RolloutRunner:
    argv = (
        f"--hf-checkpoint /m --prompt-data {data} --input-key prompt --label-key label --num-rollout 4 "
        "--rollout-batch-size 4 --n-samples-per-prompt 2 --global-batch-size 8 --colocate --rm-type math "
        "--rollout-max-response-len 6 " + extra
    ).split()
    cfg = parse_config(argv)
    return RolloutRunner(
        cfg.data, cfg.rollout, cfg.eval, tokenizer, engine.url, [engine.url], None, concurrency=64,
        dump_dir=dump_dir, transport=engine.transport,
    )  # fmt: skip


def index_of(rid: str) -> int:
    return int(re.match(r"rollout\d+-(\d+)", rid).group(1))


def test_default_rollout_single_turn(tokenizer, data, tmp_path):
    # sample index i answers the digit i % 4 (the label is one of 0-3): some right, some wrong
    engine = FakeEngine(lambda ids, sp, rid: Reply([digit(index_of(rid) % 4)], text=str(index_of(rid) % 4)))
    runner = make_runner(tokenizer, data, engine, dump_dir=str(tmp_path / "dump"))
    samples, metrics = runner.generate(0)
    assert len(samples) == 8 and all(isinstance(s, Sample) for s in samples)
    assert [s.index for s in samples] == list(range(8))
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r["rid"] for r in engine.requests] == [f"rollout0-{i}" for i in range(8)]
    for s, request in zip(samples, engine.requests):
        assert request["input_ids"] == s.tokens[: s.prompt_length]
        assert request["sampling_params"]["max_new_tokens"] == 6
        # a deterministic seed per (--rollout-seed 42, rollout 0, sample index)
        assert request["sampling_params"]["sampling_seed"] == request_seed(42, f"rollout0-{s.index}")
        assert s.response_length == 1 and s.loss_mask == [1]
        assert s.rollout_log_probs == [log_prob_of(s.tokens[-1], 0)]
        assert s.status == SampleStatus.COMPLETED and s.weight_versions == ["0"]
        assert s.train_reward == s.reward == float(s.response == s.label)
    assert metrics["rollout/raw_reward"] == sum(s.reward for s in samples) / 8
    assert metrics["rollout/filtered_groups"] == 0 and metrics["rollout/sampling_rounds"] == 1
    lines = (tmp_path / "dump" / "rollout_0000000.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(8))
    # the wave of 4 prompt groups goes out as one batch request, straight to the single engine
    assert engine.posts == 1 and engine.batch_sizes == [8]
    assert runner.generate_requests_sent == 1
    # the next rollout reuses the runner's client and loop: same answers, same batching
    client = runner._generate_client
    again, _ = runner.generate(1)
    assert runner._generate_client is client and engine.batch_sizes == [8, 8]
    assert [s.response for s in again] == [str(i % 4) for i in range(8)]
    runner.close()
    runner.close()  # idempotent


def spread_by_group(ids, sp, rid):
    """Fresh group g (sample indices 2g, 2g+1) answers right twice when g % 3 == 0 (no spread), else right once."""
    i = index_of(rid)
    prompt_digit = ids[-1] - 4  # "echo d d d d": the last prompt token is the digit
    right = (i // 2) % 3 == 0 or i % 2 == 0
    answer = prompt_digit if right else (prompt_digit + 1) % 10
    return Reply([digit(answer)], text=str(answer))


def test_dapo_dynamic_sampling_keeps_only_groups_with_spread(tokenizer, data):
    engine = FakeEngine(spread_by_group)
    runner = make_runner(
        tokenizer, data, engine,
        "--dynamic-sampling-filter-path miles.rollout.filter_hub.check_reward_nonzero_std "
        "--over-sampling-batch-size 3",
    )  # fmt: skip
    samples, metrics = runner.generate(0)
    groups = [[s for s in samples if s.group_index == g] for g in range(4)]
    assert all(
        len(g) == 2 and len({s.reward for s in g}) == 2 for g in groups
    )  # the batch is full, all spread
    assert metrics["rollout/filtered_groups"] == metrics["rollout/filtered_groups/zero_std"] >= 1
    assert (
        metrics["rollout/sampling_rounds"] >= 2
        and metrics["rollout/fresh_prompts"] == 3 * metrics["rollout/sampling_rounds"]
    )
    assert metrics["rollout/zero_std_group_frac"] == 0.0


def test_filter_that_drops_everything_raises_and_writes_no_dump(tokenizer, data, tmp_path):
    engine = FakeEngine(lambda ids, sp, rid: Reply([digit(9)], text="9"))  # every answer wrong: no spread
    runner = make_runner(
        tokenizer, data, engine,
        "--dynamic-sampling-filter-path miles.rollout.filter_hub.check_reward_nonzero_std "
        "--over-sampling-batch-size 5",
        dump_dir=str(tmp_path / "dump"),
    )  # fmt: skip
    with pytest.raises(DynamicSamplingExhausted) as info:
        runner.generate(0)
    message = str(info.value)
    assert "check_reward_nonzero_std kept 0 of the 4 groups" in message
    assert "after 5 round(s)" in message and f"{N_PROMPTS} fresh prompts" in message
    assert "'zero_std': 24" in message
    assert not (tmp_path / "dump").exists()


def test_partial_rollout_counts_every_prompt_once(tokenizer, data):
    """Over-sample 6 groups for a batch of 4: the slow ones are aborted mid-response, buffered, and continued
    next rollout with the new weights; across rollouts every prompt is trained on exactly once."""

    def respond(ids, sp, rid):
        continuing = sp["max_new_tokens"] < 6  # a continued partial response asks for what is left
        if continuing:
            return Reply([digit(3)])  # the rest of the response
        slow = index_of(rid) % 6 == 5  # 2 of the 6 groups in flight are slow
        return Reply([digit(1), digit(2), digit(3)], hold=slow, partial=2)

    engine = FakeEngine(respond)
    runner = make_runner(
        tokenizer, data, engine,
        "--partial-rollout --mask-offpolicy-in-partial-rollout --over-sampling-batch-size 6",
    )  # fmt: skip
    trained: Counter[int] = Counter()
    continued = 0
    for rollout_id in range(4):
        engine.weight_version = str(rollout_id)
        samples, metrics = runner.generate(rollout_id)
        assert len(samples) == 8
        for g in range(4):
            group = [s for s in samples if s.group_index == g]
            pids = {s.metadata["pid"] for s in group}
            assert len(pids) == 1
            trained[pids.pop()] += 1
        for s in samples:
            assert s.status == SampleStatus.COMPLETED and s.response_length == 3
            if len(s.weight_versions) == 2:  # aborted after 2 tokens, then continued with the next weights
                continued += 1
                assert s.weight_versions == [str(s.metadata["start_rollout_id"]), str(rollout_id)]
                assert s.loss_mask == [0, 0, 1] and s.metadata["start_rollout_id"] < rollout_id
                assert s.tokens[s.prompt_length :] == [digit(1), digit(2), digit(3)]
            elif (
                s.metadata["start_rollout_id"] < rollout_id
            ):  # finished in an earlier rollout: all off-policy
                assert s.weight_versions == [str(s.metadata["start_rollout_id"])] and s.loss_mask == [0, 0, 0]
            else:
                assert s.weight_versions == [str(rollout_id)] and s.loss_mask == [1, 1, 1]
        carried = sum(s.metadata["start_rollout_id"] < rollout_id for s in samples)
        assert metrics["rollout/carried_over_samples"] == carried
    assert continued > 0 and engine.aborts >= 1
    buffered = {s.metadata["pid"] for g in runner.data_source.buffer for s in g}
    assert all(n == 1 for n in trained.values())  # no prompt trained twice
    assert not buffered & set(trained)  # nor both trained and still waiting
    drawn = runner.data_source.epoch * N_PROMPTS + runner.data_source.offset
    assert len(trained) + len(buffered) == drawn  # no prompt lost


def test_without_partial_rollout_surplus_groups_are_discarded(tokenizer, data):
    engine = FakeEngine(lambda ids, sp, rid: Reply([digit(1)], hold=index_of(rid) >= 8, partial=0))
    runner = make_runner(tokenizer, data, engine, "--over-sampling-batch-size 6")
    samples, metrics = runner.generate(0)
    assert [s.index for s in samples] == list(range(8)) and metrics["rollout/discarded_groups"] == 2
    assert runner.data_source.buffer == [] and engine.aborts >= 1


@pytest.fixture
def user_fns(tmp_path, monkeypatch):
    (tmp_path / "user_rollout_fns.py").write_text(
        textwrap.dedent(
            """
            from miles.rollout.generate import generate_single_turn

            async def drops_a_log_prob(client, sample, sampling, ctx):
                sample = await generate_single_turn(client, sample, sampling, ctx)
                if sample.index == 3:
                    sample.rollout_log_probs = sample.rollout_log_probs[:-1]
                return sample

            def sync_generate(client, sample, sampling, ctx):
                return sample

            async def two_args(client, sample):
                return sample
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rollout_fns"
    sys.modules.pop("user_rollout_fns", None)


def test_generate_function_returning_inconsistent_sample_is_named(tokenizer, data, user_fns):
    engine = FakeEngine(lambda ids, sp, rid: Reply([digit(1), digit(2)]))
    runner = make_runner(
        tokenizer, data, engine, f"--custom-generate-function-path {user_fns}:drops_a_log_prob"
    )
    with pytest.raises(ValueError, match=rf"rollout generate.*{user_fns}:drops_a_log_prob.*sample index 3.*"
                       r"rollout_log_probs has 1 entries but response_length is 2"):  # fmt: skip
        runner.generate(0)


@pytest.mark.parametrize(
    ("flag", "fn", "problem"),
    [
        ("--custom-generate-function-path", "sync_generate", "is not async"),
        ("--custom-generate-function-path", "two_args", "does not fit"),
        ("--custom-generate-function-path", "missing", "has no attribute 'missing'"),
        ("--rollout-function-path", "sync_generate", "does not fit"),
        ("--dynamic-sampling-filter-path", "sync_generate", "does not fit"),
    ],
)
def test_seams_are_checked_at_start_naming_flag_and_path(tokenizer, data, user_fns, flag, fn, problem):
    from miles.rollout.seams import load_seams

    cfg = parse_config(
        f"--hf-checkpoint /m --prompt-data {data} --num-rollout 1 --rollout-batch-size 2 --global-batch-size 2 "
        f"--colocate {flag} {user_fns}:{fn}".split()
    )
    with pytest.raises(ValueError, match=rf"{flag}='{user_fns}:{fn}'.*({problem})"):
        load_seams(cfg.rollout, cfg.eval)


def test_stock_filters():
    from miles.rollout.filter_hub import check_no_aborted, check_reward_nonzero_std

    def group(rewards, statuses=None):
        statuses = statuses or [SampleStatus.COMPLETED] * len(rewards)
        return [Sample(index=i, reward=r, status=st) for i, (r, st) in enumerate(zip(rewards, statuses))]

    assert check_reward_nonzero_std(group([1.0, 0.0]), None).keep
    flat = check_reward_nonzero_std(group([1.0, 1.0, 1.0]), None)
    assert not flat.keep and flat.reason == "zero_std"
    assert not check_reward_nonzero_std(group([0.5]), None).keep  # a group of one has no spread
    dict_rewards = [Sample(reward={"score": s, "acc": 1.0}) for s in (1.0, -1.0)]
    assert (
        check_reward_nonzero_std(dict_rewards, "score").keep
        and not check_reward_nonzero_std(dict_rewards, "acc").keep
    )
    assert check_no_aborted(group([1.0, 0.0]), None).keep
    aborted = check_no_aborted(group([1.0, 0.0], [SampleStatus.COMPLETED, SampleStatus.ABORTED]), None)
    assert not aborted.keep and aborted.reason == "aborted"


def test_rollout_state_round_trips_through_json(tokenizer, data):
    """The checkpoint's rollout state: a runner restored from state_dict(0) draws the prompts rollout 1 drew."""
    engine = FakeEngine(lambda ids, sp, rid: Reply([digit(1)], text="1"))
    a = make_runner(tokenizer, data, engine, extra="--rollout-shuffle")
    a.generate(0)
    state = json.loads(json.dumps(a.state_dict(0)))
    assert state == {"data_source": {"epoch": 0, "offset": 4}, "buffer": []}
    first, _ = a.generate(1)
    b = make_runner(tokenizer, data, engine, extra="--rollout-shuffle")
    b.load_state_dict(state)
    again, _ = b.generate(1)
    assert [s.prompt for s in again] == [s.prompt for s in first]
    # kept for the one-step-off loop, which saves after the next rollout began
    assert a.state_dict(0) == state
    with pytest.raises(ValueError, match="no rollout state kept for rollout 5"):
        a.state_dict(5)


def test_generate_client_batches_per_key_and_names_every_sample_on_error():
    """Calls under one `batching` key in the same loop turn share a request (items answered in order, each
    caller its own); calls without a key go alone; a failed batch fails each of its callers naming them all; a
    batch answered with the wrong number of items is an error."""
    import asyncio

    from miles.rollout.generate_batching import batching
    from miles.rollout.generate_client import EngineError, GenerateClient

    engine = FakeEngine(lambda ids, sp, rid: Reply([ids[0], 7]))

    async def go(keyed: list[list[int]], alone: list[int]) -> list:
        async with GenerateClient(
            "http://router:1", [engine.url], None, 5.0, 16, transport=engine.transport
        ) as c:

            async def group(prompts: list[int], g: int):
                with batching(object()):
                    return await asyncio.gather(
                        *(
                            c.generate([p, 1], {"max_new_tokens": 2}, p, "test", rid=f"r{g}-{p}")
                            for p in prompts
                        )
                    )

            outs = await asyncio.gather(
                *(group(ps, g) for g, ps in enumerate(keyed)),
                *(c.generate([p], {"max_new_tokens": 2}, p, "test", rid=f"a{p}") for p in alone),
            )
            assert c.requests_sent == engine.posts
            return outs

    outs = asyncio.run(go([[10, 11, 12], [20, 21]], [30]))
    assert [[o.output_ids for o in g] for g in outs[:2]] == [[[10, 7], [11, 7], [12, 7]], [[20, 7], [21, 7]]]
    assert outs[2].output_ids == [30, 7]
    assert sorted(engine.batch_sizes) == [1, 2, 3] and engine.posts == 3
    assert all(r["return_logprob"] is True for r in engine.requests)

    bad = FakeEngine(lambda ids, sp, rid: Reply([1]))
    with pytest.raises(EngineError, match=r"samples 10, 11, 12 \(batch of 3\)"):
        asyncio.run(go_bad(bad, {"max_new_tokens": 0}))

    async def short_answer(request):
        return httpx.Response(200, json=[{"output_ids": [1], "meta_info": {}}])

    with pytest.raises(EngineError, match=r"answered a batch of 3 .* with 1 items"):
        asyncio.run(go_bad(None, {"max_new_tokens": 2}, httpx.MockTransport(short_answer)))


async def go_bad(engine, sp, transport=None):
    import asyncio

    from miles.rollout.generate_batching import batching
    from miles.rollout.generate_client import GenerateClient

    url = "http://e:1"
    async with GenerateClient(url, [url], None, 5.0, 16, transport=transport or engine.transport) as c:
        with batching("g"):
            return await asyncio.gather(*(c.generate([p], sp, p, "test", rid=f"r{p}") for p in (10, 11, 12)))


def test_generate_client_splits_one_batch_over_the_engines_that_may_take_it():
    """A batch of 7 calls and 3 engines: 3 requests of 3, 2 and 2 calls in arrival order, one per engine; an
    engine set aside takes none (its share goes to the others), and every caller gets its own answer."""
    import asyncio

    from miles.rollout.generate_batching import batching
    from miles.rollout.generate_client import GenerateClient

    engines = [FakeEngine(lambda ids, sp, rid: Reply([ids[0]]), url=f"http://e{i}:1") for i in range(3)]
    by_host = {httpx.URL(e.url).host: e for e in engines}

    async def route(request: httpx.Request) -> httpx.Response:
        return await by_host[request.url.host].transport.handle_async_request(request)

    async def go(set_aside: set[int]) -> list[int]:
        urls = [e.url for e in engines]
        async with GenerateClient(urls[0], urls, None, 5.0, 64, transport=httpx.MockTransport(route)) as c:
            c._set_aside, c._listed_at = set(set_aside), float("inf")  # no /health probe brings it back
            with batching("wave", per_engine=True):
                outs = await asyncio.gather(
                    *(c.generate([p], {"max_new_tokens": 1}, p, "test", rid=f"r{p}") for p in range(7))
                )
            return [o.output_ids[0] for o in outs]

    assert asyncio.run(go(set())) == list(range(7))
    assert [e.batch_sizes for e in engines] == [[3], [2], [2]]
    assert [r["input_ids"] for r in engines[0].requests] == [[0], [1], [2]]
    assert asyncio.run(go({1})) == list(range(7))
    assert [e.batch_sizes for e in engines] == [[3, 4], [2], [2, 3]]


def test_split_evenly():
    from miles.rollout.generate_batching import split_evenly

    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([1, 2], 5) == [[1], [2]]
    assert split_evenly([1, 2, 3], 1) == [[1, 2, 3]]


def test_generate_client_spreads_batches_over_engines():
    """Several engines: each batch goes straight to the engine with the fewest generations in flight."""
    import asyncio

    from miles.rollout.generate_batching import batching
    from miles.rollout.generate_client import GenerateClient

    engines = [FakeEngine(lambda ids, sp, rid: Reply([ids[0]]), url=f"http://e{i}:1") for i in range(2)]
    by_host = {httpx.URL(e.url).host: e for e in engines}

    async def route(request: httpx.Request) -> httpx.Response:
        return await by_host[request.url.host].transport.handle_async_request(request)

    async def go() -> None:
        urls = [e.url for e in engines]
        async with GenerateClient(
            "http://router:1", urls, None, 5.0, 64, transport=httpx.MockTransport(route)
        ) as c:

            async def group(g: int, size: int):
                with batching(g):
                    return await asyncio.gather(
                        *(
                            c.generate([g, j], {"max_new_tokens": 1}, j, "test", rid=f"{g}-{j}")
                            for j in range(size)
                        )
                    )

            await asyncio.gather(*(group(g, size) for g, size in enumerate([4, 1, 1, 2, 2])))

    asyncio.run(go())
    # every batch is whole on one engine; least-loaded choice keeps the engines within one batch of each other
    assert sorted(engines[0].batch_sizes + engines[1].batch_sizes) == [1, 1, 2, 2, 4]
    loads = [sum(e.batch_sizes) for e in engines]
    assert min(loads) > 0 and abs(loads[0] - loads[1]) <= 4
