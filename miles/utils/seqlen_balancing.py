"""Sequence-length balancing: partitions of token counts into packs, micro-batches and DP ranks.

Pure Python (no torch): every function takes plain lengths and returns lists of indices into them.

- `get_seqlen_balanced_partitions` splits items into k partitions with nearly equal token sums using the
  Karmarkar-Karp largest differencing method (k-way).
- `get_minimum_num_micro_batch_size` counts the bins first-fit decreasing needs under a token cap.
- `partition_to_packs` produces *exactly* k packs that all respect a cap (balanced when it can be).
- `partition_samples_by_dp` splits a rollout across DP ranks keeping each prompt group on one rank.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

__all__ = [
    "check_lengths_fit",
    "first_fit_decreasing",
    "get_minimum_num_micro_batch_size",
    "get_seqlen_balanced_partitions",
    "partition_samples_by_dp",
    "partition_to_packs",
]


class _State:
    """A partial k-way partition: `k` subsets (index lists) with their sums, kept sorted by sum descending."""

    __slots__ = ("sums", "subsets")

    def __init__(self, sums: list[int], subsets: list[list[int]]) -> None:
        order = sorted(range(len(sums)), key=lambda i: (-sums[i], i))
        self.sums = [sums[i] for i in order]
        self.subsets = [subsets[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: _State) -> _State:
        # Largest subset of one with the smallest of the other: this is what "differencing" means for k > 2.
        k = len(self.sums)
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        subsets = [self.subsets[i] + other.subsets[k - 1 - i] for i in range(k)]
        return _State(sums, subsets)


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Split item indices into `k_partitions` groups with nearly equal sums of `seqlen_list`.

    Karmarkar-Karp largest differencing, k-way: every item starts as a partial partition (the item alone in
    one of k subsets, or with equal_size one item per subset for each run of k items of similar size); the two
    partial partitions with the largest spread (max sum - min sum) are repeatedly merged, pairing the largest
    subset of one with the smallest subset of the other, until one partition remains.

    With `equal_size`, subsets get item counts that differ by at most one (exactly equal when k divides n);
    without it, counts are free and subsets may be empty when k > n. Every index appears exactly once; each
    returned list is sorted ascending, and the partitions are ordered by their smallest index (empty last).

    Raises ValueError when `k_partitions < 1`, when `equal_size` and `k_partitions > len(seqlen_list)`, or
    when a length is negative.
    """
    n = len(seqlen_list)
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be >= 1, got {k_partitions}")
    if equal_size and k_partitions > n:
        raise ValueError(
            f"k_partitions={k_partitions} > number of items {n} with equal_size=True; "
            f"allowed: 1 <= k_partitions <= {n}"
        )
    for i, length in enumerate(seqlen_list):
        if length < 0:
            raise ValueError(f"seqlen_list[{i}] = {length} is negative; lengths must be >= 0")
    if n == 0:
        return [[] for _ in range(k_partitions)]

    k = k_partitions
    order = sorted(range(n), key=lambda i: (-seqlen_list[i], i))
    initial: list[_State] = []
    if equal_size:
        # Pad with zero-length dummies (index -1) so n is a multiple of k; they are dropped at the end.
        order = order + [-1] * ((-n) % k)
        for start in range(0, len(order), k):
            chunk = order[start : start + k]
            initial.append(_State([seqlen_list[i] if i >= 0 else 0 for i in chunk], [[i] for i in chunk]))
    else:
        for i in order:
            initial.append(_State([seqlen_list[i]] + [0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))

    counter = itertools.count()
    heap = [(-s.spread, next(counter), s) for s in initial]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, next(counter), merged))
    final = heap[0][2]
    parts = [sorted(i for i in subset if i >= 0) for subset in final.subsets]
    parts.sort(key=lambda p: (len(p) == 0, p[0] if p else 0))
    return parts


def check_lengths_fit(lengths: Sequence[int], cap: int, cap_name: str) -> None:
    """Raise ValueError when `cap < 1` or a length is negative or above `cap` (naming index, length, flag)."""
    if cap < 1:
        raise ValueError(f"{cap_name} must be >= 1, got {cap}")
    for i, length in enumerate(lengths):
        if length > cap:
            raise ValueError(
                f"sequence {i} has {length} tokens, more than {cap_name}={cap}; "
                f"raise {cap_name} to at least {length} or shorten the sequence"
            )
        if length < 0:
            raise ValueError(f"sequence {i} has negative length {length}")


def first_fit_decreasing(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """Bins of indices packed first-fit decreasing under `cap` tokens each (no bin exceeds `cap`).

    Raises ValueError when a single length exceeds `cap` (naming its index and length) or `cap < 1`.
    """
    check_lengths_fit(lengths, cap, "cap")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= cap:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def get_minimum_num_micro_batch_size(lengths: Sequence[int], max_tokens_per_gpu: int) -> int:
    """Number of micro-batches first-fit decreasing needs so none holds more than `max_tokens_per_gpu` tokens.

    Returns 0 for no sequences. Raises ValueError when one sequence alone exceeds the cap, naming its index
    and length, or when the cap is < 1.
    """
    check_lengths_fit(lengths, max_tokens_per_gpu, "max_tokens_per_gpu")
    return len(first_fit_decreasing(lengths, max_tokens_per_gpu))


def _lpt_with_cap(lengths: Sequence[int], k: int, cap: int) -> list[list[int]] | None:
    """Longest-processing-time first into k bins under a cap; None when an item does not fit."""
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        if load + lengths[i] > cap:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def partition_to_packs(lengths: Sequence[int], k: int, cap: int | None) -> list[list[int]]:
    """Split indices into packs of at most `cap` tokens, balanced by token count.

    Returns exactly `k` non-empty packs whenever `k <= len(lengths)` and k is at least the first-fit
    decreasing count under `cap` (which `get_minimum_num_micro_batch_size` gives), so ranks that agreed on k
    all get k packs. When `k` is smaller than that, packs that would overflow are split and more than `k`
    packs come back. Tries, in order: Karmarkar-Karp into k; longest-first into the least-loaded pack under
    the cap; first-fit decreasing then splitting packs until there are k. No pack ever exceeds `cap`.

    Raises ValueError when `k < 1`, when `k > len(lengths)` (a pack would be empty), or when one length
    exceeds `cap`.
    """
    n = len(lengths)
    if k < 1:
        raise ValueError(f"number of packs must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"cannot make {k} non-empty packs from {n} sequences; allowed: 1 <= packs <= {n}")
    if cap is None:
        return get_seqlen_balanced_partitions(lengths, k, equal_size=False)
    check_lengths_fit(lengths, cap, "max_tokens_per_pack")

    def load(p: list[int]) -> int:
        return sum(lengths[i] for i in p)

    parts = get_seqlen_balanced_partitions(lengths, k, equal_size=False)
    if all(p and load(p) <= cap for p in parts):
        return parts
    lpt = _lpt_with_cap(lengths, k, cap)
    if lpt is not None and all(lpt):
        return sorted((sorted(p) for p in lpt), key=lambda p: p[0])
    packs = first_fit_decreasing(lengths, cap)
    # Fewer than k packs: move single items out of the heaviest multi-item packs into new packs.
    while len(packs) < k:
        donor = max((p for p in packs if len(p) > 1), key=lambda p: (load(p), len(p)))
        item = max(donor, key=lambda i: (lengths[i], -i))
        donor.remove(item)
        packs.append([item])
    return sorted((sorted(p) for p in packs), key=lambda p: p[0])


def partition_samples_by_dp(
    lengths: Sequence[int], group_ids: Sequence[int], dp_size: int, balance: bool
) -> list[list[int]]:
    """Split a rollout's sample indices across `dp_size` ranks, keeping each prompt group on one rank.

    Groups are the samples sharing a `group_ids` value (in first-appearance order). With `balance`, groups
    are assigned so that ranks carry nearly equal total tokens (Karmarkar-Karp over group token sums);
    otherwise groups are dealt out contiguously in order.

    Sample counts: when every group has the same size and the number of groups is a multiple of `dp_size`,
    every rank gets exactly `len(lengths) // dp_size` samples (what the trainer needs for the global batch to
    divide evenly). Otherwise exactly equal counts may be impossible; counts are then made as even as
    whole groups allow (contiguous: cut at the group boundary nearest each equal share; balanced: groups go
    largest first to the rank with the fewest samples, ties to fewer tokens), ranks may get different sample
    counts and some may be empty. Callers that need equal counts must check and drop or regroup samples.

    Returns `dp_size` lists of sample indices, each ascending. Raises ValueError when `dp_size < 1` or the
    two sequences differ in length.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if len(lengths) != len(group_ids):
        raise ValueError(f"lengths has {len(lengths)} entries but group_ids has {len(group_ids)}")
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    members = list(groups.values())
    sizes = [len(m) for m in members]
    tokens = [sum(lengths[i] for i in m) for m in members]
    n = len(lengths)

    if balance and len(set(sizes)) <= 1 and len(members) % dp_size == 0 and members:
        assignment = get_seqlen_balanced_partitions(tokens, dp_size, equal_size=True)
    elif balance:
        assignment = [[] for _ in range(dp_size)]
        counts = [0] * dp_size
        loads = [0] * dp_size
        for g in sorted(range(len(members)), key=lambda g: (-sizes[g], -tokens[g], g)):
            r = min(range(dp_size), key=lambda r: (counts[r], loads[r], r))
            assignment[r].append(g)
            counts[r] += sizes[g]
            loads[r] += tokens[g]
    else:
        assignment = [[] for _ in range(dp_size)]
        cumulative = 0
        rank = 0
        for g, size in enumerate(sizes):
            # Move on when this group would overshoot the rank's equal share more than stopping short does.
            while rank < dp_size - 1:
                target = (rank + 1) * n / dp_size
                if cumulative >= target or (
                    cumulative + size - target > target - cumulative and assignment[rank]
                ):
                    rank += 1
                else:
                    break
            assignment[rank].append(g)
            cumulative += size
    return [sorted(i for g in gs for i in members[g]) for gs in assignment]
