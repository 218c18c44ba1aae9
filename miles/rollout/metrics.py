"""Rollout and eval metrics: reward, lengths, statuses, group spread, and the unbiased pass@k estimator."""

from __future__ import annotations

import math
import statistics

from miles.utils.types import Sample, SampleStatus


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _groups(samples: list[Sample]) -> dict[int, list[Sample]]:
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s)
    return by_group


def rollout_metrics(samples: list[Sample], reward_key: str | None, num_failed: int) -> dict[str, float]:
    """`rollout/*` metrics of a trained batch (raw rewards, before any post-processing)."""
    rewards = [s.reward_value(reward_key) for s in samples]
    by_group = _groups(samples)
    flat = 0
    for group in by_group.values():
        values = [s.reward_value(reward_key) for s in group]
        flat += len(values) > 1 and max(values) == min(values)
    n = len(samples)
    multi_turn = {}
    if any("tool_calls" in s.metadata for s in samples):  # the multi-turn generate function's counters
        multi_turn = {
            "rollout/tool_calls": statistics.fmean(s.metadata.get("tool_calls", 0) for s in samples),
            "rollout/turns": statistics.fmean(s.metadata.get("turns", 0) for s in samples),
        }
    return {
        **multi_turn,
        "rollout/raw_reward": statistics.fmean(rewards),
        "rollout/response_len": statistics.fmean(s.response_length for s in samples),
        "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / n,
        "rollout/aborted_frac": sum(s.status == SampleStatus.ABORTED for s in samples) / n,
        "rollout/reward_failed": float(num_failed),
        "rollout/zero_std_group_frac": flat / max(1, len(by_group)),
    }


def eval_metrics(name: str, samples: list[Sample], reward_key: str | None) -> dict[str, float]:
    """`eval/<name>` (mean reward), `eval/<name>/pass@k` for k = 1..n (a sample is correct when its reward is
    exactly 1, n the samples per prompt), and response length / truncation statistics."""
    rewards = [s.reward_value(reward_key) for s in samples]
    lengths = [s.response_length for s in samples]
    out = {
        f"eval/{name}": statistics.fmean(rewards),
        f"eval/{name}/response_len": statistics.fmean(lengths),
        f"eval/{name}/response_len_max": float(max(lengths)),
        f"eval/{name}/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples)
        / len(samples),
    }
    groups = list(_groups(samples).values())
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(
            f"eval set {name!r}: prompt groups differ in size: {sorted({len(g) for g in groups})}"
        )
    correct = [sum(s.reward_value(reward_key) == 1.0 for s in g) for g in groups]
    for k in range(1, n + 1):
        out[f"eval/{name}/pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in correct)
    return out
