"""Named reductions of per-token losses to the scalar a micro-batch backpropagates.

Data-parallel scaling, once for all reductions. An optimizer step covers a global batch of N samples (T loss
tokens) split over `dp_size` ranks and, on each rank, over micro-batches. Each micro-batch calls backward on
``numerator(mb) / denominator``; gradients are SUMMED over a rank's micro-batches (accumulation) and then
AVERAGED over ranks by FSDP's reduce-scatter (divide by dp_size). The applied gradient is therefore

    (1 / dp_size) * sum_{all micro-batches} grad numerator(mb) / denominator,

which equals the gradient of the single-process objective sum_{all} numerator / D exactly when
``denominator = D / dp_size``. `reduction_denominator` computes that value; D is the global count named in each
reduction's docstring, so the backend must all-reduce its sample / token counts for the step BEFORE the first
micro-batch. With dp_size = 1 and one micro-batch this is the plain mean.

Metrics: `reduction_metric_count` is the local count whose global sum is D, so a metric pair
``(numerator(mb), count(mb))`` summed over micro-batches and ranks gives exactly the step's objective value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.registry import Registry


@dataclass(frozen=True)
class Reduction:
    name: str
    numerator: Callable[[list[Tensor], list[Tensor]], Tensor]  # (losses, masks) -> local differentiable sum
    local_count: Callable[[list[Tensor], float | None], float]  # (masks, constant) -> this mb's share of D
    global_count: Callable[[int, int, float | None], float]  # (num_samples, num_tokens, constant) -> D
    # whether D reads num_tokens (a backend all-reduces the token count only then); True is always safe
    counts_tokens: bool = True


REDUCTIONS: Registry[Reduction] = Registry("loss reduction")


@dataclass(frozen=True)
class LossReduction:
    """How the loss of a micro-batch is reduced: the registered reduction `kind`, its constant (constant_sum)
    and this optimizer step's `denominator` (`reduction_denominator`; it changes every step, so build it with
    ``dataclasses.replace(reduction, denominator=...)``)."""

    kind: str = "sample_mean"  # --loss-reduction: sample_mean | token_mean | constant_sum
    constant: float | None = None  # constant_sum's constant (e.g. the max response length)
    denominator: float = 1.0

    def __post_init__(self) -> None:
        # the entry's own count checks its constant (constant_sum: > 0), so the rule is stated once
        REDUCTIONS.get(self.kind).global_count(1, 0, self.constant)
        _check_denominator(self.denominator)


def _check_denominator(denominator: float) -> None:
    if not denominator > 0:
        raise ValueError(f"denominator={denominator} must be > 0")


def _masked_flat(losses: list[Tensor], masks: list[Tensor]) -> tuple[Tensor, Tensor, list[int]]:
    _ops.check_aligned("losses", losses, masks)
    lengths = _ops.lengths_of(masks)
    if not lengths:
        raise ValueError("cannot reduce an empty micro-batch (no samples)")
    flat = _ops.cat([x.float() for x in losses])
    return flat, _ops.cat(masks).to(flat.dtype), lengths


def _sample_mean_numerator(losses: list[Tensor], masks: list[Tensor]) -> Tensor:
    flat, mask, lengths = _masked_flat(losses, masks)
    return _ops.per_sample_masked_mean(flat, mask, lengths).sum()


def _token_sum(losses: list[Tensor], masks: list[Tensor]) -> Tensor:
    flat, mask, _ = _masked_flat(losses, masks)
    return _ops.masked(flat, mask).sum()


def _num_tokens(masks: list[Tensor]) -> float:
    return float(_ops.cat(masks).float().sum()) if masks else 0.0


def _constant(constant: float | None) -> float:
    if constant is None or constant <= 0:
        raise ValueError(
            f"reduction constant_sum needs a constant > 0 (e.g. the max response length), got {constant}"
        )
    return float(constant)


for _reduction in (
    # name, numerator, local count (this micro-batch's share of D), D
    Reduction(
        "sample_mean",
        _sample_mean_numerator,
        lambda masks, c: float(len(masks)),
        lambda n, t, c: float(n),
        counts_tokens=False,
    ),
    Reduction(
        "token_mean",
        _token_sum,
        lambda masks, c: _num_tokens(masks),
        lambda n, t, c: float(t),
        counts_tokens=True,
    ),
    Reduction(
        "constant_sum",
        _token_sum,
        lambda masks, c: _constant(c) * len(masks),
        lambda n, t, c: _constant(c) * n,
        counts_tokens=False,
    ),
):
    REDUCTIONS.add(_reduction.name, _reduction)


def reduction_counts_tokens(name: str) -> bool:
    """Whether reduction `name`'s D depends on the global loss-token count (token_mean), not only on the
    sample count (sample_mean, constant_sum): a backend needs that count's all-reduce only then."""
    return REDUCTIONS.get(name).counts_tokens


def reduction_denominator(
    name: str, *, global_num_samples: int, global_num_tokens: int, dp_size: int, constant: float | None = None
) -> float:
    """The `denominator` to pass to `reduce_loss` for reduction `name`: D / dp_size (module docstring), with
    D = global_num_samples (sample_mean), global_num_tokens (token_mean) or constant * global_num_samples
    (constant_sum). Counts are over the whole optimizer step on all DP ranks."""
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if global_num_samples < 1:
        raise ValueError(f"global_num_samples={global_num_samples} must be >= 1")
    if global_num_tokens < 0:
        raise ValueError(f"global_num_tokens={global_num_tokens} must be >= 0")
    d = REDUCTIONS.get(name).global_count(global_num_samples, global_num_tokens, constant)
    if d == 0:  # a step without a single loss token: every numerator is 0, any finite scale will do
        d = 1.0
    return d / dp_size


def reduce_loss(name: str, losses: list[Tensor], masks: list[Tensor], denominator: float) -> Tensor:
    """Scalar loss of one micro-batch: ``numerator / denominator`` where numerator is, per reduction:

    - ``sample_mean``: sum over samples of each sample's mean over its loss tokens. Divided by `denominator`
      = global number of samples / dp_size. A sample with no loss token (an aborted one) contributes 0 to the
      sum and still COUNTS in the number of samples: the divisor is a constant of the step (its sample count,
      as in the reference miles/slime), so how many samples were aborted does not rescale the others.
    - ``token_mean``: sum of all masked token losses. Divided by `denominator` = global number of loss
      tokens / dp_size. Every token weighs the same, however long its sequence.
    - ``constant_sum`` (Dr.GRPO): sum of all masked token losses. Divided by `denominator` = constant *
      global number of samples / dp_size, i.e. a per-sample token SUM normalised by a fixed length.

    Get `denominator` from `reduction_denominator`; see the module docstring for why it carries 1/dp_size.
    Values at mask-0 positions are never read (selected away, so nan/inf there changes neither the loss nor
    its gradient).
    """
    _check_denominator(denominator)
    return REDUCTIONS.get(name).numerator(losses, masks) / denominator


def reduction_metric(
    name: str, losses: list[Tensor], masks: list[Tensor], constant: float | None = None
) -> Tensor:
    """(numerator, local count) pair of these losses under reduction `name` (see miles.algo.metrics): summed
    over all micro-batches and ranks, numerator / count is the step's objective as `reduce_loss` defines it
    (local count: samples for sample_mean, loss tokens for token_mean, constant * samples for constant_sum)."""
    reduction = REDUCTIONS.get(name)
    num = reduction.numerator([x.detach() for x in losses], masks)
    count = reduction.local_count(masks, constant)
    return torch.stack(
        [num.double().reshape(()), torch.tensor(count, dtype=torch.float64, device=num.device)]
    )


def reduce_loss_and_metric(
    name: str, losses: list[Tensor], masks: list[Tensor], denominator: float, constant: float | None = None
) -> tuple[Tensor, Tensor]:
    """`reduce_loss` and `reduction_metric` together, computing the numerator once."""
    _check_denominator(denominator)
    reduction = REDUCTIONS.get(name)
    num = reduction.numerator(losses, masks)
    count = torch.tensor(reduction.local_count(masks, constant), dtype=torch.float64, device=num.device)
    return num / denominator, torch.stack([num.detach().double().reshape(()), count])
