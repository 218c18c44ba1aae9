"""Karmarkar-Karp partitions, first-fit micro-batch counts, exact-k packing and DP splits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.utils.seqlen_balancing import (
    first_fit_decreasing,
    get_minimum_num_micro_batch_size,
    get_seqlen_balanced_partitions,
    partition_samples_by_dp,
    partition_to_packs,
)


def _sums(parts, lengths):
    return [sum(lengths[i] for i in p) for p in parts]


def _assert_cover(parts, n):
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n))


def _kk_two_way_difference(values):
    """Plain loop reference: 2-way largest differencing on numbers only (final difference)."""
    vals = sorted(values, reverse=True)
    while len(vals) > 1:
        a, b = vals[0], vals[1]
        vals = sorted([a - b] + vals[2:], reverse=True)
    return vals[0] if vals else 0


def test_kk_textbook_example():
    lengths = [8, 7, 6, 5, 4]
    parts = get_seqlen_balanced_partitions(lengths, 2, equal_size=False)
    _assert_cover(parts, 5)
    assert sorted(_sums(parts, lengths)) == [14, 16]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40))
def test_kk_two_way_matches_loop_reference(lengths):
    parts = get_seqlen_balanced_partitions(lengths, 2, equal_size=False)
    _assert_cover(parts, len(lengths))
    s = _sums(parts, lengths)
    assert abs(s[0] - s[1]) == _kk_two_way_difference(lengths)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=60), st.integers(1, 8), st.booleans())
def test_kk_covers_every_index_once(lengths, k, equal_size):
    if equal_size and k > len(lengths):
        with pytest.raises(ValueError, match="equal_size"):
            get_seqlen_balanced_partitions(lengths, k, equal_size)
        return
    parts = get_seqlen_balanced_partitions(lengths, k, equal_size)
    assert len(parts) == k
    _assert_cover(parts, len(lengths))
    if equal_size:
        counts = [len(p) for p in parts]
        assert max(counts) - min(counts) <= 1
        if len(lengths) % k == 0:
            assert len(set(counts)) == 1


def test_kk_is_near_optimal_on_small_instances():
    # Brute force the optimum (min of max sum) on small 3-way instances; KK stays within 10% of it here.
    lengths = [31, 17, 29, 5, 12, 44, 8, 23, 19]
    best = min(
        max(sum(lengths[i] for i in range(len(lengths)) if a[i] == r) for r in range(3))
        for a in itertools.product(range(3), repeat=len(lengths))
    )
    parts = get_seqlen_balanced_partitions(lengths, 3, equal_size=False)
    assert max(_sums(parts, lengths)) <= best * 1.1


def test_kk_errors():
    with pytest.raises(ValueError, match="k_partitions must be >= 1, got 0"):
        get_seqlen_balanced_partitions([1, 2], 0, False)
    with pytest.raises(ValueError, match="k_partitions=3 > number of items 2"):
        get_seqlen_balanced_partitions([1, 2], 3, True)
    with pytest.raises(ValueError, match=r"seqlen_list\[1\] = -2"):
        get_seqlen_balanced_partitions([1, -2], 1, False)
    assert get_seqlen_balanced_partitions([1, 2], 3, False)[2] == []


def test_minimum_micro_batches():
    assert get_minimum_num_micro_batch_size([], 10) == 0
    assert get_minimum_num_micro_batch_size([5, 5, 5, 5], 10) == 2
    assert get_minimum_num_micro_batch_size([6, 5, 5, 4], 10) == 2
    assert get_minimum_num_micro_batch_size([7, 7, 7], 10) == 3
    with pytest.raises(ValueError, match="sequence 2 has 11 tokens, more than max_tokens_per_gpu=10"):
        get_minimum_num_micro_batch_size([1, 2, 11], 10)
    with pytest.raises(ValueError, match="max_tokens_per_gpu must be >= 1"):
        get_minimum_num_micro_batch_size([1], 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=50), st.integers(300, 1200), st.integers(0, 10))
def test_packs_never_exceed_cap_and_k_is_exact(lengths, cap, extra):
    k_min = get_minimum_num_micro_batch_size(lengths, cap)
    assert k_min == len(first_fit_decreasing(lengths, cap))
    k = min(k_min + extra, len(lengths))
    packs = partition_to_packs(lengths, k, cap)
    _assert_cover(packs, len(lengths))
    assert len(packs) == k
    assert all(p for p in packs)
    assert max(_sums(packs, lengths)) <= cap


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=2, max_size=40), st.integers(300, 600))
def test_packs_too_few_requested_are_split(lengths, cap):
    packs = partition_to_packs(lengths, 1, cap)
    _assert_cover(packs, len(lengths))
    assert max(_sums(packs, lengths)) <= cap
    assert len(packs) >= -(-sum(lengths) // cap)


def test_partition_to_packs_errors():
    with pytest.raises(ValueError, match="cannot make 3 non-empty packs from 2"):
        partition_to_packs([1, 2], 3, 10)
    with pytest.raises(ValueError, match="sequence 0 has 20 tokens, more than max_tokens_per_pack=10"):
        partition_to_packs([20, 2], 1, 10)


def test_dp_split_keeps_groups_and_equal_counts():
    # 8 groups of 4 samples with very different lengths; 4 ranks.
    lengths = [(g * 37) % 11 * 50 + i for g in range(8) for i in range(4)]
    group_ids = [g for g in range(8) for _ in range(4)]
    for balance in (False, True):
        ranks = partition_samples_by_dp(lengths, group_ids, 4, balance)
        _assert_cover(ranks, len(lengths))
        assert [len(r) for r in ranks] == [8, 8, 8, 8]
        for r in ranks:
            assert len({group_ids[i] for i in r}) == 2  # whole groups only
    contiguous = partition_samples_by_dp(lengths, group_ids, 4, False)
    assert contiguous[0] == list(range(8))
    balanced = partition_samples_by_dp(lengths, group_ids, 4, True)
    assert max(_sums(balanced, lengths)) <= max(_sums(contiguous, lengths))


def test_dp_split_uneven_groups():
    group_ids = [0, 0, 0, 1, 2, 2, 3]
    lengths = [10] * 7
    for balance in (False, True):
        ranks = partition_samples_by_dp(lengths, group_ids, 2, balance)
        _assert_cover(ranks, 7)
        for r in ranks:
            gs = {group_ids[i] for i in r}
            assert all(all(i in r for i, g in enumerate(group_ids) if g == g0) for g0 in gs)
        assert abs(len(ranks[0]) - len(ranks[1])) <= 1
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        partition_samples_by_dp([1], [0], 0, True)
    with pytest.raises(ValueError, match="lengths has 2 entries but group_ids has 1"):
        partition_samples_by_dp([1, 2], [0], 1, True)
