"""Advantage estimators against plain-loop references; per-group normalisation; batch whitening."""

import math
import statistics

import pytest
import torch

from miles.algo import (
    AdvantageInputs,
    AdvantageOutputs,
    checked_custom_advantage,
    compute_advantages,
    compute_approx_kl,
    discounted_returns,
    get_advantage_estimator,
    local_moments,
    masked_whiten,
    register_advantage,
)


def _batch(seed: int, group_sizes=(4, 3, 1, 5)):
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.cat([torch.full((n,), 10 * k + 7, dtype=torch.long) for k, n in enumerate(group_sizes)])
    perm = torch.randperm(group_ids.numel(), generator=g)  # groups are interleaved, not contiguous
    group_ids = group_ids[perm]
    b = group_ids.numel()
    rewards = torch.randn(b, generator=g) * torch.linspace(0.5, 5.0, b)
    lengths = torch.randint(1, 7, (b,), generator=g).tolist()
    masks = [(torch.rand(n, generator=g) > 0.3).long() for n in lengths]
    for m in masks:
        m[0] = 1
    log_probs = [-torch.rand(n, generator=g) * 2 for n in lengths]
    ref = [-torch.rand(n, generator=g) * 2 for n in lengths]
    return rewards, group_ids, masks, log_probs, ref


def _groups(rewards, group_ids):
    out = {}
    for r, gid in zip(rewards.tolist(), group_ids.tolist()):
        out.setdefault(gid, []).append(r)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_grpo_matches_loop(seed, std_normalize, name):
    rewards, group_ids, masks, _, _ = _batch(seed)
    out = compute_advantages(
        name, AdvantageInputs(rewards, group_ids, masks, std_normalize=std_normalize, eps=1e-6)
    )
    groups = _groups(rewards, group_ids)
    for i, (r, gid) in enumerate(zip(rewards.tolist(), group_ids.tolist())):
        members = groups[gid]
        if len(members) == 1:
            expected = 0.0
        else:
            expected = r - statistics.fmean(members)
            if std_normalize:
                expected /= statistics.stdev(members) + 1e-6  # unbiased (n - 1) std
        assert out.advantages[i].shape == masks[i].shape
        torch.testing.assert_close(
            out.advantages[i], torch.full_like(out.advantages[i], expected), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(out.returns[i], out.advantages[i])


def test_grpo_is_per_group_not_per_batch():
    # group 0 has tiny rewards, group 1 huge ones: per-group z-scores are identical, per-batch ones are not.
    rewards = torch.tensor([0.0, 1.0, 100.0, 200.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    masks = [torch.ones(2, dtype=torch.long)] * 4
    adv = [
        a[0].item() for a in compute_advantages("grpo", AdvantageInputs(rewards, group_ids, masks)).advantages
    ]
    s = math.sqrt(0.5)  # unbiased std of (0, 1) = std of (100, 200) / 100
    assert adv[0] == pytest.approx(-0.5 / s, rel=1e-5)
    assert adv[1] == pytest.approx(0.5 / s, rel=1e-5)
    assert adv[2] == pytest.approx(-50 / (100 * s + 1e-6), rel=1e-5)
    assert adv[3] == pytest.approx(adv[2] * -1, rel=1e-5)


def test_grpo_group_of_one_and_constant_group_are_zero():
    rewards = torch.tensor([3.0, 1.0, 1.0, 1.0])
    group_ids = torch.tensor([5, 6, 6, 6])
    masks = [torch.ones(3, dtype=torch.long)] * 4
    for std_normalize in (True, False):
        out = compute_advantages(
            "grpo", AdvantageInputs(rewards, group_ids, masks, std_normalize=std_normalize)
        )
        for a in out.advantages:
            assert torch.equal(a, torch.zeros(3))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_matches_loop(seed):
    rewards, group_ids, masks, _, _ = _batch(seed)
    out = compute_advantages("rloo", AdvantageInputs(rewards, group_ids, masks))
    for i, gid in enumerate(group_ids.tolist()):
        others = [rewards[j].item() for j in range(len(rewards)) if j != i and group_ids[j].item() == gid]
        expected = rewards[i].item() - statistics.fmean(others) if others else 0.0
        torch.testing.assert_close(
            out.advantages[i], torch.full_like(out.advantages[i], expected), rtol=1e-5, atol=1e-5
        )


def test_rloo_hand():
    out = compute_advantages(
        "rloo", AdvantageInputs(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0]), [torch.ones(1)] * 3)
    )
    assert [a.item() for a in out.advantages] == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5])


def test_discounted_returns_hand():
    # mask 0 at position 2 is skipped: it neither gets a return nor consumes a discount step
    rewards = torch.tensor([1.0, 0.0, 5.0, 2.0])
    mask = torch.tensor([1, 1, 0, 1])
    out = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 0.0, 2.0]))


def _reinforce_loop(rewards, masks, log_probs, ref, kl_coef, kl_type, gamma):
    out = []
    for r, m, lp, rf in zip(rewards, masks, log_probs, ref):
        m = m.tolist()
        kl = compute_approx_kl(lp, rf, kl_type).tolist()
        token_rewards = [(-kl_coef * k if mm else 0.0) for k, mm in zip(kl, m)]
        last = max(t for t in range(len(m)) if m[t])
        token_rewards[last] += r
        ret = [0.0] * len(m)
        g = 0.0
        for t in reversed(range(len(m))):
            if m[t]:
                g = token_rewards[t] + gamma * g
                ret[t] = g
        out.append(ret)
    return out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_plus_plus_matches_loop(seed, gamma, baseline):
    rewards, group_ids, masks, log_probs, ref = _batch(seed)
    name = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    inputs = AdvantageInputs(
        rewards,
        group_ids,
        masks,
        log_probs=log_probs,
        ref_log_probs=ref,
        kl_coef=0.1,
        kl_type="k3",
        gamma=gamma,
    )
    out = compute_advantages(name, inputs)
    r = rewards.tolist()
    if baseline:
        groups = _groups(rewards, group_ids)
        r = [x - statistics.fmean(groups[g]) for x, g in zip(r, group_ids.tolist())]
    expected = _reinforce_loop(r, masks, log_probs, ref, 0.1, "k3", gamma)
    for a, ret, e in zip(out.advantages, out.returns, expected):
        torch.testing.assert_close(ret, torch.tensor(e), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, ret)
    assert get_advantage_estimator(name).whiten
    assert not get_advantage_estimator("grpo").whiten


def test_reinforce_reward_lands_on_last_loss_token():
    inputs = AdvantageInputs(torch.tensor([2.0]), torch.tensor([0]), [torch.tensor([1, 1, 0])], gamma=1.0)
    out = compute_advantages("reinforce_plus_plus", inputs)
    torch.testing.assert_close(out.returns[0], torch.tensor([2.0, 2.0, 0.0]))


def test_kl_penalty_needs_log_probs():
    with pytest.raises(ValueError, match="kl_coef=0.1 needs log_probs and ref_log_probs"):
        compute_advantages(
            "reinforce_plus_plus",
            AdvantageInputs(torch.ones(1), torch.zeros(1, dtype=torch.long), [torch.ones(2)], kl_coef=0.1),
        )


@pytest.mark.parametrize("seed", [0, 1])
def test_whiten_over_two_ranks_equals_union(seed):
    _, _, masks, values, _ = _batch(seed)
    values = [v * 3 + 1 for v in values]
    half = len(values) // 2
    stats = local_moments(values[:half], masks[:half]) + local_moments(
        values[half:], masks[half:]
    )  # all-reduce
    assert stats.dtype == torch.float64
    whitened = masked_whiten(values[:half], masks[:half], stats) + masked_whiten(
        values[half:], masks[half:], stats
    )
    kept = [x for v, m in zip(values, masks) for x, mm in zip(v.tolist(), m.tolist()) if mm]
    mean = statistics.fmean(kept)
    std = statistics.pstdev(kept)  # biased (population) variance over the DP batch's loss tokens
    for v, m, w in zip(values, masks, whitened):
        expected = [
            ((x - mean) / math.sqrt(std * std + 1e-8)) if mm else 0.0 for x, mm in zip(v.tolist(), m.tolist())
        ]
        torch.testing.assert_close(w, torch.tensor(expected), rtol=1e-4, atol=1e-5)
    flat = torch.cat([w[m.bool()] for w, m in zip(whitened, masks)])
    assert abs(flat.mean().item()) < 1e-5


def test_whiten_errors():
    with pytest.raises(ValueError, match="cannot whiten over 0"):
        masked_whiten([torch.ones(2)], [torch.zeros(2)], torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="Tensor\\[3\\]"):
        masked_whiten([torch.ones(2)], [torch.ones(2)], torch.zeros(2))


def test_inputs_validation():
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        AdvantageInputs(torch.ones(2), torch.zeros(2), [torch.ones(1)] * 2)
    with pytest.raises(ValueError, match="1 loss_masks for 2 rewards"):
        AdvantageInputs(torch.ones(2), torch.zeros(2, dtype=torch.long), [torch.ones(1)])
    with pytest.raises(ValueError, match="log_probs\\[0\\] has shape \\(3,\\)"):
        AdvantageInputs(
            torch.ones(1), torch.zeros(1, dtype=torch.long), [torch.ones(2)], log_probs=[torch.ones(3)]
        )
    with pytest.raises(ValueError, match="kl_type='k9'"):
        AdvantageInputs(torch.ones(1), torch.zeros(1, dtype=torch.long), [torch.ones(2)], kl_type="k9")
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        compute_advantages(
            "gae", AdvantageInputs(torch.ones(1), torch.zeros(1, dtype=torch.long), [torch.ones(2)])
        )
    assert AdvantageInputs(
        torch.ones(2), torch.zeros(2, dtype=torch.long), [torch.ones(3), torch.ones(1)]
    ).response_lengths == [3, 1]


def test_register_duplicate_rejected():
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):

        @register_advantage("grpo")
        def again(inputs):  # pragma: no cover - never registered
            raise AssertionError


def test_custom_advantage_contract_is_checked():
    def double_reward(inputs):
        adv = [torch.full(m.shape, 2.0 * float(r)) for r, m in zip(inputs.rewards, inputs.loss_masks)]
        return AdvantageOutputs(advantages=adv, returns=adv)

    def wrong_shape(inputs):
        return AdvantageOutputs(advantages=[torch.zeros(99)], returns=[torch.zeros(99)])

    inputs = AdvantageInputs(torch.tensor([1.5]), torch.tensor([0]), [torch.ones(2)])
    out = checked_custom_advantage(double_reward, "mod:double_reward")(inputs)
    assert isinstance(out, AdvantageOutputs)
    torch.testing.assert_close(out.advantages[0], torch.tensor([3.0, 3.0]))
    with pytest.raises(ValueError, match="mod:wrong_shape advantages\\[0\\] has shape \\(99,\\)"):
        checked_custom_advantage(wrong_shape, "mod:wrong_shape")(inputs)
    with pytest.raises(ValueError, match="'mod:none' returned NoneType, expected AdvantageOutputs"):
        checked_custom_advantage(lambda inputs: None, "mod:none")(inputs)
