"""pack_sequences / unpack_sequences / plan_micro_batches on CPU, no model needed."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.fsdp_utils.data_packing import (
    PackedBatch,
    pack_sequences,
    plan_micro_batches,
    unpack_sequences,
)
from miles.utils.types import Sample


def _sample(prompt_len: int, resp_len: int, seed: int, **extra) -> dict:
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 50) for _ in range(prompt_len + resp_len)]
    d = {"tokens": tokens, "response_length": resp_len}
    d.update(extra)
    return d


def _check_pack(p: PackedBatch, samples: list[dict]) -> None:
    t = p.num_tokens
    assert p.tokens.shape == (t,) and p.position_ids.shape == (t,)
    assert p.cu_seqlens.dtype == torch.int32 and int(p.cu_seqlens[-1]) == t
    for j, idx in enumerate(p.sample_indices.tolist()):
        s, e = int(p.cu_seqlens[j]), int(p.cu_seqlens[j + 1])
        assert p.tokens[s:e].tolist() == list(samples[idx]["tokens"])
        assert p.position_ids[s:e].tolist() == list(range(e - s))
        assert int(p.response_lengths[j]) == samples[idx]["response_length"]
        assert int(p.prompt_lengths[j]) == e - s - samples[idx]["response_length"]


def test_pack_fields_and_roundtrip():
    samples = [
        _sample(3, 4, 0, loss_mask=[1, 0, 1, 1], advantages=[0.5] * 4, reward=1.0),
        _sample(2, 1, 1, loss_mask=[1], advantages=torch.tensor([-1.0]), reward=0.0),
        _sample(5, 3, 2, loss_mask=[0, 0, 1], advantages=[2.0, 2.0, 2.0], reward=0.5),
    ]
    packs = pack_sequences(samples, num_packs=2)
    assert len(packs) == 2
    assert sorted(i for p in packs for i in p.sample_indices.tolist()) == [0, 1, 2]
    for p in packs:
        _check_pack(p, samples)
        assert p.loss_masks.shape == (p.num_response_tokens,)
        assert p.rollout_log_probs is None and p.ref_log_probs is None
        per_sample_adv = unpack_sequences(p.advantages, p)
        per_sample_mask = unpack_sequences(p.loss_masks, p)
        for j, idx in enumerate(p.sample_indices.tolist()):
            assert per_sample_adv[j].tolist() == pytest.approx(list(map(float, samples[idx]["advantages"])))
            assert per_sample_mask[j].tolist() == [float(v) for v in samples[idx]["loss_mask"]]
            assert float(p.rewards[j]) == samples[idx]["reward"]


def test_unpack_uses_boundaries_not_token_values():
    # A response ending in token 0, and a sample made only of token id 0 (id 0 is a real token).
    samples = [
        {"tokens": [5, 6, 7, 0, 0], "response_length": 3},
        {"tokens": [0, 0, 0, 0], "response_length": 2},
        {"tokens": [9, 0], "response_length": 1},
    ]
    (p,) = pack_sequences(samples, num_packs=1)
    _check_pack(p, samples)
    token_aligned = unpack_sequences(p.tokens, p)
    assert [x.tolist() for x in token_aligned] == [[7, 0, 0], [0, 0], [0]]
    resp_layout = torch.arange(p.num_response_tokens, dtype=torch.float32)
    assert [x.tolist() for x in unpack_sequences(resp_layout, p)] == [[0.0, 1.0, 2.0], [3.0, 4.0], [5.0]]
    assert p.response_token_positions().tolist() == [2, 3, 4, 7, 8, 10]
    assert p.logit_positions().tolist() == [1, 2, 3, 6, 7, 9]
    with pytest.raises(ValueError, match="leading size 7; allowed: 11 .pack tokens. or 6"):
        unpack_sequences(torch.zeros(7), p)


def test_unpack_is_differentiable():
    samples = [_sample(2, 3, 0), _sample(1, 2, 1)]
    (p,) = pack_sequences(samples, num_packs=1)
    x = torch.randn(p.num_response_tokens, requires_grad=True)
    parts = unpack_sequences(x, p)
    (parts[0].sum() * 2 + parts[1].sum()).backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0, 1.0, 1.0]


def test_pack_accepts_sample_records():
    s = Sample(tokens=[1, 2, 3, 0], response_length=2, loss_mask=[1, 0], rollout_log_probs=[-0.1, -0.2])
    (p,) = pack_sequences([s, s], max_tokens_per_pack=8)
    assert p.num_sequences == 2 and p.loss_masks.tolist() == [1, 0, 1, 0]
    assert p.rollout_log_probs.tolist() == pytest.approx([-0.1, -0.2, -0.1, -0.2])


def test_pack_errors():
    with pytest.raises(ValueError, match="needs num_packs or max_tokens_per_pack"):
        pack_sequences([_sample(2, 2, 0)])
    with pytest.raises(ValueError, match="response_length=3 with 3 tokens"):
        pack_sequences([{"tokens": [1, 2, 3], "response_length": 3}], num_packs=1)
    with pytest.raises(ValueError, match="loss_mask has 1 values, response_length is 2"):
        pack_sequences([_sample(2, 2, 0, loss_mask=[1])], num_packs=1)
    with pytest.raises(
        ValueError, match=r"advantages is given for some samples but missing for samples \[1\]"
    ):
        pack_sequences([_sample(2, 1, 0, advantages=[1.0]), _sample(2, 1, 1)], num_packs=1)
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than max_tokens_per_pack=8"):
        pack_sequences([_sample(2, 2, 0), _sample(4, 5, 1)], max_tokens_per_pack=8)
    with pytest.raises(ValueError, match="cannot make 3 non-empty packs from 2"):
        pack_sequences([_sample(2, 2, 0), _sample(4, 5, 1)], num_packs=3)
    assert pack_sequences([], max_tokens_per_pack=8) == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=30),
    st.integers(100, 400),
    st.one_of(st.none(), st.integers(1, 12)),
)
def test_pack_property_every_index_once_never_over_cap(shapes, cap, num_packs):
    samples = [_sample(p, r, i) for i, (p, r) in enumerate(shapes)]
    if num_packs is not None:
        num_packs = min(num_packs, len(samples))
    packs = pack_sequences(samples, num_packs=num_packs, max_tokens_per_pack=cap)
    indices = sorted(i for p in packs for i in p.sample_indices.tolist())
    assert indices == list(range(len(samples)))
    assert all(0 < p.num_tokens <= cap for p in packs)
    for p in packs:
        _check_pack(p, samples)


def test_plan_static():
    plan = plan_micro_batches(
        [5] * 8,
        global_batch_size=8,
        use_dynamic=False,
        max_tokens_per_gpu=None,
        micro_batch_size=2,
        dp_size=2,
    )
    assert plan == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ValueError, match="micro_batch_size=3 must be >= 1 and divide"):
        plan_micro_batches(
            [5] * 8,
            global_batch_size=8,
            use_dynamic=False,
            max_tokens_per_gpu=None,
            micro_batch_size=3,
            dp_size=2,
        )
    with pytest.raises(ValueError, match="this rank has 7 samples, not a multiple"):
        plan_micro_batches(
            [5] * 7,
            global_batch_size=8,
            use_dynamic=False,
            max_tokens_per_gpu=None,
            micro_batch_size=2,
            dp_size=2,
        )


def test_plan_dynamic_uses_agreed_count_and_cap():
    lengths = [10, 10, 10, 10, 90, 20, 30, 40]
    calls = []

    def fake_max(v: int) -> int:  # another rank needs 4 micro-batches
        calls.append(v)
        return max(v, 4)

    plan = plan_micro_batches(
        lengths,
        global_batch_size=8,
        use_dynamic=True,
        max_tokens_per_gpu=50,
        micro_batch_size=None,
        dp_size=2,
        cp_size=2,
        allreduce_max=fake_max,
    )
    assert calls == [1, 2]  # caps at 100 tokens: [40 tokens] fits one, [90,20,30,40] needs two
    assert [len(step) for step in plan] == [4, 4]
    for step in plan:
        for mb in step:
            assert mb and sum(lengths[i] for i in mb) <= 100
    assert sorted(i for step in plan for mb in step for i in mb) == list(range(8))
    with pytest.raises(ValueError, match="needs allreduce_max"):
        plan_micro_batches(
            lengths,
            global_batch_size=8,
            use_dynamic=True,
            max_tokens_per_gpu=50,
            micro_batch_size=None,
            dp_size=2,
        )
    with pytest.raises(ValueError, match="agreed on 9 micro-batches but this rank has only 4"):
        plan_micro_batches(
            lengths,
            global_batch_size=8,
            use_dynamic=True,
            max_tokens_per_gpu=50,
            micro_batch_size=None,
            dp_size=2,
            allreduce_max=lambda v: 9,
        )


def test_plan_dynamic_puts_a_sample_over_the_cap_in_a_micro_batch_of_its_own(caplog):
    """The reference's behaviour: a sample longer than --max-tokens-per-gpu * cp is trained alone (logged),
    where the planner used to raise mid-run; the other samples are planned as without it."""
    lengths = [10, 130, 20, 30, 40, 101, 20, 10]  # step 0: 130 over the cap of 100; step 1: 101
    with caplog.at_level("WARNING", logger="miles.backends.fsdp_utils.data_packing"):
        plan = plan_micro_batches(lengths, global_batch_size=4, use_dynamic=True, max_tokens_per_gpu=50,
                                  micro_batch_size=None, dp_size=1, cp_size=2)  # fmt: skip
    assert plan == [[[0, 2, 3], [1]], [[4, 6, 7], [5]]]
    assert "1 sample(s) of [130] tokens exceed" in caplog.text and "[101]" in caplog.text
    assert "--max-tokens-per-gpu" in caplog.text
    # DP ranks still agree: another rank needing 3 micro-batches splits the fitting samples further.
    plan = plan_micro_batches(lengths[:4], global_batch_size=8, use_dynamic=True, max_tokens_per_gpu=50,
                              micro_batch_size=None, dp_size=2, cp_size=2, allreduce_max=lambda v: max(v, 3))  # fmt: skip
    (step,) = plan
    assert len(step) == 3 and [1] in step and sorted(i for mb in step for i in mb) == [0, 1, 2, 3]
    assert all(sum(lengths[i] for i in mb) <= 100 for mb in step if mb != [1])
    # Only over-long samples: one micro-batch each.
    plan = plan_micro_batches([300, 200], global_batch_size=2, use_dynamic=True, max_tokens_per_gpu=100,
                              micro_batch_size=None, dp_size=1)  # fmt: skip
    assert plan == [[[0], [1]]]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100), min_size=8, max_size=8),
    cap=st.integers(100, 300),
    dp_need=st.integers(0, 8),
)
def test_plan_dynamic_when_every_sample_fits_is_the_plain_balanced_plan(lengths, cap, dp_need):
    """The over-long rule leaves a batch whose samples all fit exactly as it was: the minimum first-fit count
    (or the DP ranks' agreed count) of balanced packs, in partition_to_packs' order."""
    from miles.utils.seqlen_balancing import get_minimum_num_micro_batch_size, partition_to_packs

    agree = lambda v: max(v, dp_need)  # noqa: E731
    plan = plan_micro_batches(lengths, global_batch_size=16, use_dynamic=True, max_tokens_per_gpu=cap,
                              micro_batch_size=None, dp_size=2, allreduce_max=agree)  # fmt: skip
    expected = [partition_to_packs(lengths, agree(get_minimum_num_micro_batch_size(lengths, cap)), cap)]
    assert plan == expected


def test_response_token_positions_skip_sequences_without_response():
    samples = [
        {"tokens": [1, 2, 3], "response_length": 0},
        {"tokens": [4, 5, 6, 7], "response_length": 2},
        {"tokens": [8, 9], "response_length": 0},
        {"tokens": [10, 11, 12], "response_length": 1},
    ]
    (p,) = pack_sequences(samples, num_packs=1)
    order = p.sample_indices.tolist()
    expected, start = [], 0
    for i in order:  # the loop the vectorised positions replace
        n, r = len(samples[i]["tokens"]), samples[i]["response_length"]
        expected += list(range(start + n - r, start + n))
        start += n
    assert p.response_token_positions().tolist() == expected and len(expected) == 3
    assert p.tokens[p.response_token_positions()].tolist() == [
        t
        for i in order
        for t in samples[i]["tokens"][len(samples[i]["tokens"]) - samples[i]["response_length"] :]
    ]


@pytest.mark.parametrize("cap", [None, 10_000])
def test_one_pack_is_every_sample_in_input_order(cap):
    """pack_sequences' shortcut for a single pack gives what the balanced partition gives."""
    from miles.utils.seqlen_balancing import partition_to_packs

    rng = random.Random(3)
    lengths = [rng.randint(2, 90) for _ in range(37)]
    assert partition_to_packs(lengths, 1, cap) == [list(range(len(lengths)))]
    samples = [{"tokens": list(range(1, n + 1)), "response_length": 1} for n in lengths]
    (p,) = pack_sequences(samples, num_packs=1, max_tokens_per_pack=cap)
    assert p.sample_indices.tolist() == list(range(len(lengths)))
