"""Metric records that average correctly over micro-batches and data-parallel ranks.

Every metric that miles.algo returns is a float64 ``Tensor[2] = (numerator, count)``: the value over any set of
micro-batches and ranks is ``sum(numerators) / sum(counts)``. So the backend adds the pairs of its micro-batches
(`accumulate_metrics`), all-reduces the stacked pairs with SUM over the DP group (`stack_metrics` /
`unstack_metrics` give one tensor for one collective) and divides (`finalize_metrics`). Averaging per-micro-batch
means instead would weight a micro-batch of 3 tokens like one of 3000.
"""

from __future__ import annotations

import torch
from torch import Tensor


def metric(numerator: Tensor | float, count: Tensor | float) -> Tensor:
    """A detached float64 ``Tensor[2] = (numerator, count)``."""
    num = torch.as_tensor(numerator).detach().double().reshape(())
    den = torch.as_tensor(count).detach().double().reshape(()).to(num.device)
    return torch.stack([num, den])


def masked_metric(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over mask == 1 positions, as a (sum, count) pair (values at mask-0 positions, even
    nan/inf, are never read)."""
    m = mask.detach().double()
    kept = torch.where(
        m != 0, values.detach().double() * m, torch.zeros((), dtype=torch.float64, device=m.device)
    )
    return metric(kept.sum(), m.sum())


def accumulate_metrics(total: dict[str, Tensor], new: dict[str, Tensor]) -> dict[str, Tensor]:
    """Add the pairs of `new` into `total` (in place; keys missing from `total` are added) and return it."""
    for key, pair in new.items():
        if pair.shape != (2,):
            raise ValueError(
                f"metric {key!r} must be a (numerator, count) Tensor[2], got {tuple(pair.shape)}"
            )
        total[key] = total[key] + pair if key in total else pair.clone()
    return total


def stack_metrics(metrics: dict[str, Tensor]) -> tuple[list[str], Tensor]:
    """(sorted keys, Tensor[K, 2]) so all metrics can be all-reduced in one collective. Every rank must hold
    the same keys (they are fixed by the loss settings)."""
    keys = sorted(metrics)
    if not keys:
        return [], torch.zeros(0, 2, dtype=torch.float64)
    return keys, torch.stack([metrics[k].double() for k in keys])


def unstack_metrics(keys: list[str], stacked: Tensor) -> dict[str, Tensor]:
    """Inverse of `stack_metrics`."""
    if stacked.shape != (len(keys), 2):
        raise ValueError(f"stacked metrics have shape {tuple(stacked.shape)}, expected ({len(keys)}, 2)")
    return {k: stacked[i] for i, k in enumerate(keys)}


def finalize_metrics(total: dict[str, Tensor]) -> dict[str, float]:
    """numerator / count per metric; a metric whose count is 0 (e.g. no loss tokens at all) is left out."""
    out = {}
    for key, pair in total.items():
        num, den = (float(x) for x in pair)
        if den != 0:
            out[key] = num / den
    return out
