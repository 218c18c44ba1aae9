"""Numeric holes (issue 8, item 6): non-finite values at loss-mask-0 positions, overflowing ratios, equal groups.

Each test compares a poisoned input with the same input holding ordinary values at the masked positions (the
clean case is itself checked against plain loops in the other test_algo_* files), or with a plain loop.
"""

import dataclasses
import math

import pytest
import torch

from miles.algo import (
    OPSM,
    AdvantageInputs,
    KLPenalty,
    LossInputs,
    LossReduction,
    LossSettings,
    PolicyLossSpec,
    compute_advantages,
    compute_approx_kl,
    compute_loss,
    compute_mis_mask,
    compute_mismatch_weights,
    compute_opsm_mask,
    compute_policy_loss,
    finalize_metrics,
    get_policy_loss,
    local_moments,
    masked_metric,
    masked_whiten,
    reduce_loss,
    reduction_denominator,
)
from miles.algo.mismatch import MIS, TIS, TISAndMIS

POISONS = [float("nan"), float("inf"), float("-inf")]


def _masks(lengths=(3, 5, 2, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    masks = [(torch.rand(n, generator=g) > 0.4).float() for n in lengths]
    for m in masks:
        m[0] = 1.0
        if m.numel() > 1:
            m[-1] = 0.0  # every sample has a masked position to poison
    return masks


def _poison(values, masks, poison):
    """A copy of `values` with `poison` at every mask-0 position (requires_grad kept)."""
    out = []
    for v, m in zip(values, masks):
        p = torch.where(m == 0, torch.full_like(v.detach(), poison), v.detach())
        out.append(p.requires_grad_(v.requires_grad))
    return out


def _loss_inputs(seed, masks):
    g = torch.Generator().manual_seed(seed)
    lengths = [m.numel() for m in masks]
    lp = [(-torch.rand(n, generator=g) * 2).requires_grad_() for n in lengths]
    old = [x.detach() + torch.randn(n, generator=g) * 0.2 for x, n in zip(lp, lengths)]
    return LossInputs(
        log_probs=lp,
        old_log_probs=old,
        advantages=[torch.randn(n, generator=g) for n in lengths],
        loss_masks=masks,
        ref_log_probs=[x.detach() + torch.randn(n, generator=g) * 0.3 for x, n in zip(lp, lengths)],
        rollout_log_probs=[o + torch.randn(n, generator=g) * 0.3 for o, n in zip(old, lengths)],
        entropy=[torch.rand(n, generator=g).requires_grad_() for n in lengths],
    )


SETTINGS = [
    LossSettings(
        policy=PolicyLossSpec(eps_clip_c=3.0, opsm=OPSM(delta=0.01)),
        kl=KLPenalty(coef=0.05, type="k3", unbiased=True),
        entropy_coef=0.01,
        mismatch=TISAndMIS(TIS(lo=0.5, hi=1.5), MIS(lo=0.3, hi=2.5)),
        reduction=LossReduction(denominator=4.0),
    ),
    LossSettings(
        policy=PolicyLossSpec(name="gspo"),
        kl=KLPenalty(coef=0.1, type="low_var_kl"),
        mismatch=MIS(level="sequence"),
        reduction=LossReduction(kind="token_mean", denominator=9.0),
    ),
    LossSettings(
        entropy_coef=0.02, reduction=LossReduction(kind="constant_sum", constant=6.0, denominator=24.0)
    ),
]


def _poisoned_inputs(inp, poison):
    m = inp.loss_masks
    return dataclasses.replace(
        inp,
        log_probs=_poison(inp.log_probs, m, poison),
        old_log_probs=_poison(inp.old_log_probs, m, poison),
        advantages=_poison(inp.advantages, m, poison),
        ref_log_probs=_poison(inp.ref_log_probs, m, poison),
        rollout_log_probs=_poison(inp.rollout_log_probs, m, poison),
        entropy=_poison(inp.entropy, m, poison),
    )


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("settings_index", range(len(SETTINGS)))
def test_loss_ignores_non_finite_values_at_masked_positions(poison, settings_index):
    settings = SETTINGS[settings_index]
    clean = _loss_inputs(7, _masks())
    bad = _poisoned_inputs(clean, poison)
    loss, metrics = compute_loss(clean, settings)
    bad_loss, bad_metrics = compute_loss(bad, settings)
    assert torch.isfinite(bad_loss)
    torch.testing.assert_close(bad_loss, loss, rtol=0, atol=0)
    assert finalize_metrics(bad_metrics) == finalize_metrics(metrics)
    grads = torch.autograd.grad(loss, clean.log_probs + clean.entropy)
    bad_grads = torch.autograd.grad(bad_loss, bad.log_probs + bad.entropy)
    for g, bg, m in zip(grads, bad_grads, clean.loss_masks + clean.loss_masks):
        assert torch.isfinite(bg).all()
        torch.testing.assert_close(bg, g, rtol=0, atol=0)
        assert torch.all(bg[m == 0] == 0)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name", ["sample_mean", "token_mean", "constant_sum"])
def test_reductions_ignore_masked_non_finite(poison, name):
    masks = _masks()
    losses = [
        torch.randn(m.numel(), generator=torch.Generator().manual_seed(3)).requires_grad_() for m in masks
    ]
    bad = _poison(losses, masks, poison)
    bad_value = reduce_loss(name, bad, masks, 2.0)
    assert torch.equal(bad_value, reduce_loss(name, losses, masks, 2.0))
    (grad,) = torch.autograd.grad(bad_value, bad[0])
    assert torch.isfinite(grad).all() and grad[-1] == 0 and torch.all(grad[masks[0] != 0] != 0)


@pytest.mark.parametrize("poison", POISONS)
def test_policy_losses_and_opsm_ignore_masked_non_finite(poison):
    clean = _loss_inputs(2, _masks())
    bad = _poisoned_inputs(clean, poison)
    for name in ("ppo", "gspo"):
        outs = []
        for inp in (clean, bad):
            out = get_policy_loss(name)(
                inp.log_probs,
                inp.old_log_probs,
                inp.advantages,
                inp.loss_masks,
                PolicyLossSpec(name=name, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0),
            )
            outs.append(out)
        for a, b, m in zip(outs[0].loss, outs[1].loss, clean.loss_masks):
            assert torch.equal(a[m != 0], b[m != 0])
            assert torch.isfinite(b).all()
    keep = compute_opsm_mask(
        clean.log_probs, clean.rollout_log_probs, clean.advantages, clean.loss_masks, OPSM(0.01)
    )
    bad_keep = compute_opsm_mask(
        bad.log_probs, bad.rollout_log_probs, bad.advantages, bad.loss_masks, OPSM(0.01)
    )
    assert all(torch.equal(a, b) for a, b in zip(keep, bad_keep))


@pytest.mark.parametrize("poison", POISONS)
def test_mismatch_weights_and_metrics_ignore_masked_non_finite(poison):
    clean = _loss_inputs(4, _masks())
    bad = _poisoned_inputs(clean, poison)
    correction = TISAndMIS(TIS(lo=0.5, hi=1.5), MIS(level="sequence", lo=0.3, hi=2.5))
    w, metrics = compute_mismatch_weights(
        clean.old_log_probs, clean.rollout_log_probs, clean.loss_masks, correction
    )
    bw, bad_metrics = compute_mismatch_weights(
        bad.old_log_probs, bad.rollout_log_probs, bad.loss_masks, correction
    )
    assert finalize_metrics(bad_metrics) == finalize_metrics(metrics)
    for a, b, m in zip(w, bw, clean.loss_masks):
        assert torch.equal(a[m != 0], b[m != 0]) and torch.isfinite(b).all()
    for level in ("token", "sequence"):
        keep = compute_mis_mask(
            bad.old_log_probs, bad.rollout_log_probs, bad.loss_masks, MIS(level, 0.3, 2.5)
        )
        ref = compute_mis_mask(
            clean.old_log_probs, clean.rollout_log_probs, clean.loss_masks, MIS(level, 0.3, 2.5)
        )
        for a, b, m in zip(ref, keep, clean.loss_masks):
            assert torch.equal(a[m != 0], b[m != 0])
    flat_mask = torch.cat(clean.loss_masks)
    assert torch.equal(
        masked_metric(torch.cat(bad.advantages), flat_mask),
        masked_metric(torch.cat(clean.advantages), flat_mask),
    )


@pytest.mark.parametrize("poison", POISONS)
def test_whitening_ignores_masked_non_finite(poison):
    masks = _masks()
    values = [torch.randn(m.numel(), generator=torch.Generator().manual_seed(i)) for i, m in enumerate(masks)]
    bad = _poison(values, masks, poison)
    stats = local_moments(values, masks)
    assert torch.equal(local_moments(bad, masks), stats)
    out = masked_whiten(bad, masks, stats)
    ref = masked_whiten(values, masks, stats)
    for a, b, m in zip(ref, out, masks):
        assert torch.equal(a, b) and torch.all(b[m == 0] == 0)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_kl_penalised_returns_ignore_masked_non_finite(poison, name):
    clean = _loss_inputs(5, _masks())
    bad = _poisoned_inputs(clean, poison)

    def run(inp):
        return compute_advantages(
            name,
            AdvantageInputs(
                rewards=torch.tensor([1.0, 0.0, 0.5, 2.0]),
                group_ids=torch.tensor([0, 0, 1, 1]),
                loss_masks=inp.loss_masks,
                log_probs=[x.detach() for x in inp.log_probs],
                ref_log_probs=inp.ref_log_probs,
                kl_coef=0.1,
                kl_type="k3",
            ),
        )

    for a, b in zip(run(clean).advantages, run(bad).advantages):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------- overflowing ratios


def _clip(eps_clip, eps_clip_high, eps_clip_c=None):
    return PolicyLossSpec(eps_clip=eps_clip, eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c)


@pytest.mark.parametrize("eps_clip_c", [None, 3.0])
@pytest.mark.parametrize("log_ratio,adv", [(100.0, 1.0), (100.0, -1.0), (-100.0, -1.0), (1000.0, 1.0)])
def test_clipped_token_with_huge_ratio_has_zero_gradient_not_nan(log_ratio, adv, eps_clip_c):
    new = torch.tensor([log_ratio], requires_grad=True)
    old = torch.zeros(1)
    loss, clipfrac = compute_policy_loss(old - new, torch.tensor([adv]), _clip(0.2, 0.2, eps_clip_c))
    assert torch.isfinite(loss).all()
    (grad,) = torch.autograd.grad(loss.sum(), new)
    assert torch.isfinite(grad).all()
    if adv > 0 or eps_clip_c is not None or log_ratio < 0:
        # clipped (A > 0, ratio above 1 + eps), dual-clipped (A < 0, huge ratio), or clipped below 1 - eps
        assert grad.item() == 0.0
    if adv > 0:
        assert loss.item() == pytest.approx(-adv * 1.2)
        assert clipfrac.item() == 1.0


@pytest.mark.parametrize("log_ratio", [-19.5, -3.0, 0.0, 0.1, 19.5])
def test_log_ratio_clamp_leaves_ordinary_ratios_exact(log_ratio):
    new = torch.tensor([log_ratio])
    loss, _ = compute_policy_loss(-new, torch.tensor([-1.0]), _clip(1e9, 1e9))
    assert loss.item() == pytest.approx(math.exp(log_ratio), rel=1e-6)


def test_log_ratio_is_clamped_at_20():
    loss, _ = compute_policy_loss(torch.tensor([-25.0, 25.0]), torch.tensor([-1.0, -1.0]), _clip(1e30, 1e30))
    torch.testing.assert_close(loss, torch.tensor([math.exp(20.0), math.exp(-20.0)]))


def test_unbiased_kl_weight_cannot_overflow():
    lp = torch.tensor([0.0, -0.5], requires_grad=True)
    kl = compute_approx_kl(lp, torch.tensor([-1.0, -0.5]), "k2", old_log_probs=torch.tensor([-200.0, -0.5]))
    assert torch.isfinite(kl).all()
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    assert torch.isfinite(grad).all()


# -------------------------------------------------------------------------------------------- equal groups


@pytest.mark.parametrize("value", [5.3, 0.1, -7.77, 123456.789])
@pytest.mark.parametrize("n", [2, 7, 8])
@pytest.mark.parametrize(
    "name,std_normalize",
    [("grpo", True), ("grpo", False), ("gspo", True), ("rloo", True), ("reinforce_plus_plus_baseline", True)],
)
def test_equal_rewards_give_exactly_zero_advantage(value, n, name, std_normalize):
    rewards = torch.tensor([value] * n + [0.0, 1.0])  # plus a group with a spread
    group_ids = torch.tensor([3] * n + [9, 9])
    masks = [torch.ones(2) for _ in range(n + 2)]
    out = compute_advantages(name, AdvantageInputs(rewards, group_ids, masks, std_normalize=std_normalize))
    for a in out.advantages[:n]:
        assert torch.equal(a, torch.zeros(2)), a
    assert all(torch.all(a != 0) for a in out.advantages[n:])


def test_group_statistics_in_float64_match_a_loop():
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(12, generator=g) * 1000 + 1e4).float()  # large offset: float32 sums lose digits
    group_ids = torch.tensor([0] * 6 + [1] * 6)
    masks = [torch.ones(1) for _ in range(12)]
    out = compute_advantages("grpo", AdvantageInputs(rewards, group_ids, masks))
    values = rewards.double().tolist()
    for i in range(12):
        members = values[:6] if i < 6 else values[6:]
        mean = math.fsum(members) / 6
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in members) / 5)
        assert out.advantages[i].item() == pytest.approx((values[i] - mean) / (std + 1e-6), rel=1e-6)


# ------------------------------------------------------------------------------ samples without loss tokens


def test_sample_without_loss_tokens_counts_in_the_sample_mean_denominator():
    """Decision: an aborted sample (loss mask all 0) contributes 0 to the numerator and 1 to the sample count,
    so its siblings' per-sample means are divided by the step's full sample count (a constant of the step, as
    in the reference miles/slime), whatever was aborted."""
    losses = [torch.tensor([1.0, 3.0]), torch.tensor([float("nan"), float("nan")]), torch.tensor([5.0])]
    masks = [torch.ones(2), torch.zeros(2), torch.ones(1)]
    denominator = reduction_denominator("sample_mean", global_num_samples=3, global_num_tokens=3, dp_size=1)
    assert denominator == 3.0
    assert reduce_loss("sample_mean", losses, masks, denominator).item() == pytest.approx((2.0 + 5.0) / 3)
