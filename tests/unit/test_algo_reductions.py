"""Reductions: loop references, and the DP scaling (2 ranks x 2 micro-batches == one process, one batch)."""

import pytest
import torch

from miles.algo import (
    REDUCTIONS,
    accumulate_metrics,
    finalize_metrics,
    reduce_loss,
    reduce_loss_and_metric,
    reduction_counts_tokens,
    reduction_denominator,
    reduction_metric,
    stack_metrics,
    unstack_metrics,
)

NAMES = ["sample_mean", "token_mean", "constant_sum"]
CONSTANT = 7.0


def _data(seed, lengths=(3, 1, 5, 2, 4, 6, 2, 3)):
    g = torch.Generator().manual_seed(seed)
    feats = [torch.randn(n, 4, generator=g) for n in lengths]
    masks = [(torch.rand(n, generator=g) > 0.3).float() for n in lengths]
    masks[1][0] = 0.0  # one sample without any loss token
    theta = torch.randn(4, generator=g)
    return feats, masks, theta


def _token_losses(feats, theta):
    return [torch.tanh(f @ theta) ** 2 + f[:, 0] * theta[1] for f in feats]


def _loop_objective(name, losses, masks):
    n = len(losses)
    t = sum(float(m.sum()) for m in masks)
    total = 0
    for loss, m in zip(losses, masks):
        s = sum(loss[k] * m[k] for k in range(len(m)))
        if name == "sample_mean":
            total = total + (s / float(m.sum()) if m.sum() > 0 else 0.0) / n
        elif name == "token_mean":
            total = total + s / t
        else:
            total = total + s / (CONSTANT * n)
    return total


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_single_batch_matches_loop(name, seed):
    feats, masks, theta = _data(seed)
    losses = _token_losses(feats, theta)
    denom = reduction_denominator(
        name,
        global_num_samples=len(masks),
        global_num_tokens=int(sum(m.sum() for m in masks)),
        dp_size=1,
        constant=CONSTANT,
    )
    torch.testing.assert_close(reduce_loss(name, losses, masks, denom), _loop_objective(name, losses, masks))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp2_times_two_micro_batches_equals_single_batch(name, seed):
    feats, masks, theta0 = _data(seed)
    n = len(masks)
    t = int(sum(m.sum() for m in masks))

    theta = theta0.clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(_loop_objective(name, _token_losses(feats, theta), masks), theta)

    # 2 ranks, each 2 micro-batches of unequal size; counts are global (all-reduced before the step)
    shards = [[[0], [1, 2, 3]], [[4, 5], [6, 7]]]
    denom = reduction_denominator(
        name, global_num_samples=n, global_num_tokens=t, dp_size=2, constant=CONSTANT
    )
    rank_grads, pairs = [], {}
    for rank in shards:
        theta = theta0.clone().requires_grad_()
        for mb in rank:  # gradient accumulation: backward on every micro-batch, grads add up
            loss, pair = reduce_loss_and_metric(
                name, _token_losses([feats[i] for i in mb], theta), [masks[i] for i in mb], denom, CONSTANT
            )
            loss.backward()
            accumulate_metrics(pairs, {"loss": pair})
        rank_grads.append(theta.grad)
    fsdp_grad = sum(rank_grads) / 2  # FSDP reduce-scatter AVERAGES over dp ranks
    torch.testing.assert_close(fsdp_grad, ref_grad)
    # the metric pairs, summed over micro-batches and ranks, give the single-batch objective value
    value = _loop_objective(name, _token_losses(feats, theta0), masks)
    assert finalize_metrics(pairs)["loss"] == pytest.approx(float(value), rel=1e-5)


def test_naive_local_mean_would_be_wrong():
    # guard that the test above can fail: per-micro-batch token means do not give the global token mean
    feats, masks, theta0 = _data(0)
    ref = _loop_objective("token_mean", _token_losses(feats, theta0), masks)
    naive = 0
    for mb in [[0], [1, 2, 3], [4, 5], [6, 7]]:
        mt = sum(float(masks[i].sum()) for i in mb)
        naive += reduce_loss(
            "token_mean", _token_losses([feats[i] for i in mb], theta0), [masks[i] for i in mb], mt
        )
    assert abs(float(naive) / 4 - float(ref)) > 1e-3


def test_denominators():
    kw = dict(global_num_samples=16, global_num_tokens=400, dp_size=4)
    assert reduction_denominator("sample_mean", **kw) == 4.0
    assert reduction_denominator("token_mean", **kw) == 100.0
    assert reduction_denominator("constant_sum", constant=8.0, **kw) == 32.0
    assert (
        reduction_denominator(
            "constant_sum", constant=0.5, global_num_samples=1, global_num_tokens=3, dp_size=1
        )
        == 0.5
    )
    assert reduction_denominator("token_mean", global_num_samples=2, global_num_tokens=0, dp_size=1) == 1.0


def test_reduction_metric_counts():
    losses = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])]
    assert reduction_metric("sample_mean", losses, masks).tolist() == [1.5 + 4.0, 2.0]
    assert reduction_metric("token_mean", losses, masks).tolist() == [7.0, 3.0]
    assert reduction_metric("constant_sum", losses, masks, constant=10.0).tolist() == [7.0, 20.0]


def test_metric_stacking_roundtrip():
    pairs = {
        "b": torch.tensor([1.0, 2.0], dtype=torch.float64),
        "a": torch.tensor([3.0, 4.0], dtype=torch.float64),
    }
    keys, stacked = stack_metrics(pairs)
    assert keys == ["a", "b"] and stacked.shape == (2, 2)
    back = unstack_metrics(keys, stacked * 2)  # e.g. after an all-reduce SUM over 2 identical ranks
    assert finalize_metrics(back) == {"a": 0.75, "b": 0.5}
    assert finalize_metrics({"empty": torch.zeros(2)}) == {}


def test_errors():
    one = ([torch.ones(2)], [torch.ones(2)])
    with pytest.raises(ValueError, match="unknown loss reduction 'mean'; choose one of"):
        reduce_loss("mean", *one, 1.0)
    with pytest.raises(ValueError, match="denominator=0"):
        reduce_loss("token_mean", *one, 0)
    with pytest.raises(ValueError, match="constant_sum needs a constant > 0"):
        reduction_denominator("constant_sum", global_num_samples=1, global_num_tokens=1, dp_size=1)
    with pytest.raises(ValueError, match="dp_size=0"):
        reduction_denominator("token_mean", global_num_samples=1, global_num_tokens=1, dp_size=0)
    with pytest.raises(ValueError, match="empty micro-batch"):
        reduce_loss("token_mean", [], [], 1.0)
    with pytest.raises(ValueError, match="losses\\[0\\] has shape"):
        reduce_loss("token_mean", [torch.ones(3)], [torch.ones(2)], 1.0)


@pytest.mark.parametrize("name", sorted(REDUCTIONS.names()))
def test_reduction_counts_tokens_says_whether_the_denominator_reads_tokens(name: str) -> None:
    """A reduction flagged as not counting tokens has a denominator that no token count moves (the FSDP trainer
    then skips the token count's all-reduce); one that counts them is moved by it."""
    dens = {
        t: reduction_denominator(
            name, global_num_samples=8, global_num_tokens=t, dp_size=2, constant=CONSTANT
        )
        for t in (3, 40, 500)
    }
    assert reduction_counts_tokens(name) == (len(set(dens.values())) > 1), dens
    assert reduction_counts_tokens("token_mean") and not reduction_counts_tokens("sample_mean")
