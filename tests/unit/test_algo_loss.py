"""The composed loss: loop reference (value and gradients), first-micro-step identities, settings, hooks."""

import dataclasses
import math

import pytest
import torch

from miles.algo import (
    MIS,
    OPSM,
    TIS,
    CustomMismatch,
    KLPenalty,
    LossInputs,
    LossReduction,
    LossSettings,
    PolicyLossSpec,
    TISAndMIS,
    compute_loss,
    finalize_metrics,
)


def _inputs(seed, lengths=(3, 5, 2, 4), with_grad=True):
    g = torch.Generator().manual_seed(seed)
    lp = [(-torch.rand(n, generator=g) * 2).requires_grad_(with_grad) for n in lengths]
    old = [x.detach() + torch.randn(n, generator=g) * 0.2 for x, n in zip(lp, lengths)]
    rollout = [o + torch.randn(n, generator=g) * 0.3 for o, n in zip(old, lengths)]
    ref = [x.detach() + torch.randn(n, generator=g) * 0.3 for x, n in zip(lp, lengths)]
    adv = [torch.randn(n, generator=g) for n in lengths]
    ent = [torch.rand(n, generator=g).requires_grad_(with_grad) for n in lengths]
    masks = [(torch.rand(n, generator=g) > 0.2).float() for n in lengths]
    for m in masks:
        m[0] = 1.0
    return LossInputs(
        log_probs=lp,
        old_log_probs=old,
        advantages=adv,
        loss_masks=masks,
        ref_log_probs=ref,
        rollout_log_probs=rollout,
        entropy=ent,
    )


def _loop_loss(inp: LossInputs, s: LossSettings):
    """Plain per-token loop of the whole objective (sample_mean reduction, ppo, TIS + token MIS, k3 KL)."""
    total = 0
    for i in range(len(inp.loss_masks)):
        per_sample = 0
        count = 0
        for t in range(inp.loss_masks[i].numel()):
            if not inp.loss_masks[i][t]:
                continue
            count += 1
            lp, old, a = inp.log_probs[i][t], inp.old_log_probs[i][t], inp.advantages[i][t]
            ratio = torch.exp(lp - old)
            p, tis, mis = s.policy, s.mismatch.tis, s.mismatch.mis
            pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - p.eps_clip, 1 + p.clip_high))
            if a < 0:
                pg = torch.minimum(pg, -a * p.eps_clip_c)
            is_ratio = math.exp(old.item() - inp.rollout_log_probs[i][t].item())
            w = min(max(is_ratio, tis.lo), tis.hi) if mis.lo <= is_ratio <= mis.hi else 0.0
            d = lp - inp.ref_log_probs[i][t]
            kl = torch.exp(-d) - 1 + d
            per_sample = per_sample + w * pg - s.entropy_coef * inp.entropy[i][t] + s.kl.coef * kl
        total = total + per_sample / count
    return total / s.reduction.denominator


FULL = LossSettings(
    policy=PolicyLossSpec(name="ppo", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0),
    kl=KLPenalty(coef=0.05, type="k3"),
    entropy_coef=0.01,
    mismatch=TISAndMIS(TIS(lo=0.5, hi=1.5), MIS(level="token", lo=0.3, hi=2.5)),
    reduction=LossReduction(kind="sample_mean", denominator=4.0),
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_loss_matches_loop_value_and_gradients(seed):
    inp = _inputs(seed)
    loss, metrics = compute_loss(inp, FULL)
    ref = _loop_loss(inp, FULL)
    torch.testing.assert_close(loss, ref)
    params = inp.log_probs + inp.entropy
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b)
    assert set(metrics) >= {
        "loss",
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "kl_loss",
        "entropy_loss",
        "tis",
        "tis_clipfrac",
        "ois",
        "mis_masked_frac",
        "train_rollout_logprob_abs_diff",
    }
    assert all(v.shape == (2,) and v.dtype == torch.float64 for v in metrics.values())
    # one micro-batch, dp 1, denominator == number of samples: the loss metric reads as the loss itself
    assert finalize_metrics(metrics)["loss"] == pytest.approx(loss.item(), rel=1e-5)
    values = finalize_metrics(metrics)
    combined = (
        values["pg_loss"] - FULL.entropy_coef * values["entropy_loss"] + FULL.kl.coef * values["kl_loss"]
    )
    assert values["loss"] == pytest.approx(combined, rel=1e-5)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
@pytest.mark.parametrize("use_opsm", [False, True])
def test_first_micro_step_identities(policy_loss, use_opsm):
    inp = _inputs(5)
    inp.old_log_probs = [x.detach().clone() for x in inp.log_probs]  # same weights => ppo_kl == 0 exactly
    inp.rollout_log_probs = None
    masks = [torch.ones_like(m) for m in inp.loss_masks]
    inp.loss_masks = masks
    n_tokens = sum(m.numel() for m in masks)
    settings = LossSettings(
        policy=PolicyLossSpec(name=policy_loss, opsm=OPSM() if use_opsm else None),
        reduction=LossReduction(kind="token_mean", denominator=n_tokens),
    )
    loss, metrics = compute_loss(inp, settings)
    assert metrics["ppo_kl"][0].item() == 0.0
    assert metrics["pg_clipfrac"][0].item() == 0.0
    assert torch.equal(loss, -torch.cat(inp.advantages).sum() / n_tokens)
    assert finalize_metrics(metrics)["pg_loss"] == pytest.approx(
        -torch.cat(inp.advantages).mean().item(), rel=1e-6
    )


DENOM_4 = LossReduction(denominator=4.0)


def test_use_rollout_logprobs_uses_rollout_as_old():
    inp = _inputs(1)
    settings = LossSettings(policy=PolicyLossSpec(use_rollout_logprobs=True), reduction=DENOM_4)
    swapped = dataclasses.replace(inp, old_log_probs=inp.rollout_log_probs, rollout_log_probs=None)
    loss_a, m_a = compute_loss(inp, settings)
    loss_b, m_b = compute_loss(swapped, LossSettings(reduction=DENOM_4))
    torch.testing.assert_close(loss_a, loss_b)
    assert torch.equal(m_a["ppo_kl"], m_b["ppo_kl"])
    assert "train_rollout_logprob_abs_diff" in m_a  # mismatch is still reported


def test_opsm_drops_off_policy_negative_samples():
    inp = _inputs(2)
    inp.entropy = None
    inp.loss_masks = [torch.ones_like(m) for m in inp.loss_masks]
    inp.advantages = [torch.full_like(a, -1.0) for a in inp.advantages]
    # sample 0 drifted far from the behaviour (rollout) policy: log pi_rollout - log pi = 1 > delta
    inp.rollout_log_probs[0] = inp.log_probs[0].detach() + 1.0
    base = LossSettings(policy=PolicyLossSpec(opsm=OPSM(delta=0.5)), reduction=DENOM_4)
    loss, metrics = compute_loss(inp, base)
    expected = dataclasses.replace(
        inp,
        log_probs=inp.log_probs[1:],
        old_log_probs=inp.old_log_probs[1:],
        advantages=inp.advantages[1:],
        loss_masks=inp.loss_masks[1:],
        ref_log_probs=None,
        rollout_log_probs=None,
    )
    ref_loss, _ = compute_loss(expected, LossSettings(reduction=DENOM_4))
    torch.testing.assert_close(loss, ref_loss)
    assert finalize_metrics(metrics)["opsm_masked_frac"] == pytest.approx(3 / 14)


def test_custom_mismatch_function_replaces_the_weights():
    seen = []

    def zero(old, rollout, masks, settings):
        seen.append(settings)
        return [torch.zeros(m.shape) for m in masks], {}

    inp = _inputs(3)
    settings = LossSettings(mismatch=CustomMismatch(zero), reduction=DENOM_4)
    loss, metrics = compute_loss(inp, settings)
    assert finalize_metrics(metrics)["pg_loss"] == 0.0
    assert seen == [settings]  # the function receives the micro-batch's settings


def test_records_validate_their_values():
    cases = [
        (lambda: PolicyLossSpec(name="trpo"), "policy_loss='trpo'"),
        (lambda: PolicyLossSpec(eps_clip_c=0.9), "eps_clip_c=0.9"),
        (lambda: PolicyLossSpec(eps_clip=-0.1), "eps_clip=-0.1"),
        (lambda: OPSM(delta=-1.0), "opsm_delta=-1.0"),
        (lambda: KLPenalty(coef=0.1, type="k7"), "kl_type 'k7'"),
        (lambda: TIS(lo=3.0, hi=2.0), "tis_clip_low \\(3.0\\) <= tis_clip \\(2.0\\)"),
        (lambda: MIS(level="seq"), "mis_level='seq'"),
        (lambda: MIS(lo=2.0, hi=1.0), "mis_lower \\(2.0\\) <= mis_upper \\(1.0\\)"),
        (lambda: LossReduction(kind="mean"), "loss reduction 'mean'"),
        (lambda: LossReduction(denominator=0), "denominator=0"),
        (lambda: LossReduction(kind="constant_sum"), "constant_sum needs a constant > 0"),
        (
            lambda: LossSettings(policy=PolicyLossSpec(use_rollout_logprobs=True), mismatch=TIS()),
            "correct for the same mismatch twice",
        ),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build()
    assert PolicyLossSpec(eps_clip=0.1).clip_high == 0.1


def test_missing_inputs():
    inp = _inputs(0)
    with pytest.raises(ValueError, match="use_kl_loss\\) needs ref_log_probs"):
        compute_loss(dataclasses.replace(inp, ref_log_probs=None), FULL)
    with pytest.raises(ValueError, match="TISAndMIS needs rollout_log_probs"):
        compute_loss(dataclasses.replace(inp, rollout_log_probs=None), FULL)
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs entropy"):
        compute_loss(dataclasses.replace(inp, entropy=None), FULL)
    with pytest.raises(ValueError, match="advantages\\[1\\] has shape"):
        LossInputs(
            inp.log_probs[:2], inp.old_log_probs[:2], [torch.zeros(3), torch.zeros(1)], inp.loss_masks[:2]
        )


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("reduction", ["token_mean", "constant_sum"])
def test_kl_loss_term_matches_loop(unbiased, reduction):
    inp = _inputs(4)
    settings = LossSettings(
        kl=KLPenalty(coef=1.0, type="k2", unbiased=unbiased),
        reduction=LossReduction(kind=reduction, constant=3.0, denominator=5.0),
    )
    _, metrics = compute_loss(inp, settings)
    num = 0.0
    for lp, old, ref, m in zip(inp.log_probs, inp.old_log_probs, inp.ref_log_probs, inp.loss_masks):
        for t in range(m.numel()):
            if m[t]:
                d = lp[t].item() - ref[t].item()
                w = math.exp(lp[t].item() - old[t].item()) if unbiased else 1.0
                num += w * 0.5 * d * d
    count = sum(float(m.sum()) for m in inp.loss_masks) if reduction == "token_mean" else 3.0 * 4
    assert metrics["kl_loss"].tolist() == pytest.approx([num, count], rel=1e-5)
