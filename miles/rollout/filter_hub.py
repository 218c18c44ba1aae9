"""Stock group filters for dynamic sampling (`--dynamic-sampling-filter-path`).

A filter is called once per finished, scored prompt group as `fn(group, reward_key) -> FilterResult` (see
`miles.rollout.base_types.GroupFilterFn`). A dropped group is counted in `rollout/filtered_groups/<reason>`.
"""

from __future__ import annotations

import statistics

from miles.rollout.base_types import FilterResult
from miles.utils.types import Sample, SampleStatus

STD_EPS = 1e-6


def check_reward_nonzero_std(group: list[Sample], reward_key: str | None) -> FilterResult:
    """Keep a group only when its rewards have a spread (DAPO: a group whose samples all score the same gives
    zero group-normalized advantage, so it only dilutes the batch). Reason: `zero_std`."""
    rewards = [s.reward_value(reward_key) for s in group]
    spread = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    return FilterResult(keep=spread > STD_EPS, reason=None if spread > STD_EPS else "zero_std")


def check_no_aborted(group: list[Sample], reward_key: str | None) -> FilterResult:
    """Drop a group in which any sample was aborted (or failed): it carries a truncated or no learning signal.
    Reason: `aborted`."""
    bad = any(s.status in (SampleStatus.ABORTED, SampleStatus.FAILED) for s in group)
    return FilterResult(keep=not bad, reason="aborted" if bad else None)
