"""GAE (`--advantage-estimator ppo`) and the critic's value loss against plain-loop references."""

import math

import pytest
import torch

from miles.algo import (
    AdvantageInputs,
    LossReduction,
    compute_advantages,
    compute_approx_kl,
    get_advantage_estimator,
)
from miles.algo.advantages import gae
from miles.algo.reductions import reduction_denominator
from miles.algo.value_loss import ValueLossInputs, compute_value_loss, explained_variance


def _loop_gae(reward, kl, kl_coef, values, mask, gamma, lambd):
    """Reference: walk the FULL response backwards; a mask-0 token is skipped (not a step of the episode), so
    the "next value" and the running advantage carry over it unchanged."""
    n = len(mask)
    last = max((t for t in range(n) if mask[t]), default=None)
    adv, ret = [0.0] * n, [0.0] * n
    next_value, running = 0.0, 0.0
    for t in range(n - 1, -1, -1):
        if not mask[t]:
            continue
        r = -kl_coef * kl[t] + (reward if t == last else 0.0)
        delta = r + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        adv[t] = running
        ret[t] = running + values[t]
        next_value = values[t]
    return adv, ret


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    b = 7
    lengths = torch.randint(1, 12, (b,), generator=g).tolist()
    masks = []
    for n in lengths:  # multi-turn style: runs of 1s separated by runs of 0s (tool output)
        m = (torch.rand(n, generator=g) > 0.35).long()
        masks.append(m)
    masks[0] = torch.zeros(lengths[0], dtype=torch.long)  # a sample with no loss token at all
    rewards = torch.randn(b, generator=g)
    values = [torch.randn(n, generator=g) for n in lengths]
    lp = [-torch.rand(n, generator=g) for n in lengths]
    ref = [-torch.rand(n, generator=g) for n in lengths]
    return rewards, masks, values, lp, ref


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_ppo_gae_matches_loop(seed, gamma, lambd, kl_coef):
    rewards, masks, values, lp, ref = _batch(seed)
    inputs = AdvantageInputs(
        rewards=rewards,
        group_ids=torch.arange(len(masks)),
        loss_masks=masks,
        values=values,
        log_probs=lp,
        ref_log_probs=ref,
        kl_coef=kl_coef,
        gamma=gamma,
        lambd=lambd,
    )
    out = compute_advantages("ppo", inputs)
    for i, mask in enumerate(masks):
        kl = compute_approx_kl(lp[i], ref[i], "k1").tolist()
        adv, ret = _loop_gae(float(rewards[i]), kl, kl_coef, values[i].tolist(), mask.tolist(), gamma, lambd)
        torch.testing.assert_close(out.advantages[i], torch.tensor(adv), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.returns[i], torch.tensor(ret), rtol=1e-5, atol=1e-6)
        assert out.advantages[i].dtype == torch.float32
    assert get_advantage_estimator("ppo").whiten


def test_gae_lambda_one_is_return_minus_value_and_lambda_zero_is_td():
    mask = torch.tensor([1, 1, 0, 1, 1])
    values = torch.tensor([0.5, -0.2, 9.0, 0.1, 0.3])
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lambd=1.0)
    # lambda = 1: A_t = G_t - V_t with G the discounted return over loss tokens (the 0 step is skipped)
    g = [2.0 * 0.9**3, 2.0 * 0.9**2, 0.0, 2.0 * 0.9, 2.0]
    for t in (0, 1, 3, 4):
        assert math.isclose(float(adv[t]), g[t] - float(values[t]), rel_tol=1e-6)
        assert math.isclose(float(ret[t]), g[t], rel_tol=1e-6)
    assert float(adv[2]) == 0.0 and float(ret[2]) == 0.0
    adv0, _ = gae(rewards, values, mask, gamma=0.9, lambd=0.0)
    # lambda = 0: one-step TD error, next value across the masked gap
    assert math.isclose(float(adv0[1]), 0.9 * 0.1 - (-0.2), rel_tol=1e-6)
    assert math.isclose(float(adv0[4]), 2.0 - 0.3, rel_tol=1e-6)


def test_ppo_needs_values_and_rejects_bad_lambda():
    masks = [torch.ones(3)]
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages("ppo", AdvantageInputs(torch.ones(1), torch.zeros(1, dtype=torch.long), masks))
    with pytest.raises(ValueError, match="lambd"):
        AdvantageInputs(
            torch.ones(1), torch.zeros(1, dtype=torch.long), masks, values=[torch.ones(3)], lambd=1.5
        )
    with pytest.raises(ValueError, match="values"):
        AdvantageInputs(torch.ones(1), torch.zeros(1, dtype=torch.long), masks, values=[torch.ones(2)])


def _loop_value_loss(v, old, ret, mask, clip):
    per_sample = []
    clipped_count, n = 0, 0
    for vi, oi, ri, mi in zip(v, old, ret, mask):
        terms = []
        for a, o, r, m in zip(vi.tolist(), oi.tolist(), ri.tolist(), mi.tolist()):
            if not m:
                continue
            un = (a - r) ** 2
            if clip is None:
                terms.append(0.5 * un)
                n += 1
                continue
            vc = o + min(max(a - o, -clip), clip)
            cl = (vc - r) ** 2
            terms.append(0.5 * max(un, cl))
            clipped_count += abs(a - o) > clip and cl > un
            n += 1
        per_sample.append(sum(terms) / len(terms) if terms else 0.0)
    return sum(per_sample) / len(per_sample), clipped_count / n


@pytest.mark.parametrize("clip", [None, 0.2, 5.0])
def test_value_loss_matches_loop_and_grad_flows(clip):
    g = torch.Generator().manual_seed(3)
    lengths = [4, 1, 6]
    v = [torch.randn(n, generator=g).requires_grad_() for n in lengths]
    old = [torch.randn(n, generator=g) for n in lengths]
    ret = [torch.randn(n, generator=g) for n in lengths]
    mask = [torch.tensor([1, 0, 1, 1.0]), torch.tensor([1.0]), torch.tensor([0, 1, 1, 1, 0, 1.0])]
    den = reduction_denominator("sample_mean", global_num_samples=3, global_num_tokens=0, dp_size=1)
    loss, m = compute_value_loss(ValueLossInputs(v, old, ret, mask), clip, LossReduction(denominator=den))
    ref_loss, ref_frac = _loop_value_loss(v, old, ret, mask, clip)
    assert math.isclose(float(loss.detach()), ref_loss, rel_tol=1e-5)
    assert math.isclose(float(m["value_clipfrac"][0] / m["value_clipfrac"][1]), ref_frac, abs_tol=1e-9)
    loss.backward()
    assert v[2].grad[0] == 0 and v[2].grad[4] == 0  # masked tokens get no gradient
    assert v[0].grad.abs().sum() > 0


def test_explained_variance():
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for pred, want in ((ret, 1.0), (torch.full((4,), 2.5), 0.0)):
        err = ret - pred
        ev = explained_variance(
            4, float(ret.sum()), float((ret**2).sum()), float(err.sum()), float((err**2).sum())
        )
        assert math.isclose(ev, want, abs_tol=1e-9)
    assert math.isnan(explained_variance(2, 2.0, 2.0, 0.0, 0.0))
