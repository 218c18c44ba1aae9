"""PPO / GSPO policy losses and OPSM against loop references, hand cases and autograd."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.algo import (
    OPSM,
    PolicyLossSpec,
    compute_opsm_mask,
    compute_policy_loss,
    get_policy_loss,
    register_policy_loss,
)


def _clip(eps_clip, eps_clip_high, eps_clip_c=None, name="ppo"):
    return PolicyLossSpec(name=name, eps_clip=eps_clip, eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c)


def _loop_ppo(ppo_kl, adv, eps_lo, eps_hi, eps_c):
    losses, clips = [], []
    for k, a in zip(ppo_kl.tolist(), adv.tolist()):
        ratio = math.exp(-k)
        unclipped = -a * ratio
        clipped = -a * min(max(ratio, 1 - eps_lo), 1 + eps_hi)
        loss = max(unclipped, clipped)
        if eps_c is not None and a < 0:
            loss = min(loss, -a * eps_c)
        losses.append(loss)
        clips.append(1.0 if clipped > unclipped else 0.0)
    return torch.tensor(losses), torch.tensor(clips)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_compute_policy_loss_matches_loop(seed, eps):
    g = torch.Generator().manual_seed(seed)
    ppo_kl = torch.randn(64, generator=g) * 0.7
    adv = torch.randn(64, generator=g)
    loss, clip = compute_policy_loss(ppo_kl, adv, _clip(*eps))
    ref_loss, ref_clip = _loop_ppo(ppo_kl, adv, *eps)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(clip, ref_clip)


def test_hand_cases_clip_both_sides_and_dual_clip():
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 5.0, 1.1])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, -2.0, 1.0])
    loss, clip = compute_policy_loss(-torch.log(ratio), adv, _clip(0.2, 0.3))
    # A>0, ratio above 1+0.3: clipped to 1.3; A<0, ratio below 0.8: clipped to 0.8;
    # A<0 with ratio up / A>0 with ratio down: the unclipped (larger) loss is kept, no clip
    expected = torch.tensor([-1.3, 0.8, 1.5, -0.5, 10.0, -1.1])
    torch.testing.assert_close(loss, expected)
    assert clip.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    dual, _ = compute_policy_loss(-torch.log(ratio), adv, _clip(0.2, 0.3, eps_clip_c=3.0))
    torch.testing.assert_close(dual, torch.tensor([-1.3, 0.8, 1.5, -0.5, 6.0, -1.1]))  # 2 * 5 capped at 2 * 3


def test_zero_ppo_kl_gives_ratio_one():
    adv = torch.randn(10)
    log_probs = [torch.randn(4, requires_grad=True), torch.randn(6, requires_grad=True)]
    out = get_policy_loss("ppo")(
        log_probs,
        [x.detach().clone() for x in log_probs],
        list(adv.split([4, 6])),
        [torch.ones(4), torch.ones(6)],
        _clip(0.2, 0.2, 3.0),
    )
    assert torch.equal(torch.cat(out.ppo_kl), torch.zeros(10))
    assert torch.equal(torch.cat(out.clipfrac), torch.zeros(10))
    assert torch.equal(torch.cat(out.loss), -adv)


def _autograd_ref_ppo(log_probs, old, adv, eps_lo, eps_hi):
    total = 0
    for lp, o, a in zip(log_probs, old, adv):
        for t in range(lp.numel()):
            ratio = torch.exp(lp[t] - o[t])
            total = total + torch.maximum(-a[t] * ratio, -a[t] * torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi))
    return total


def _sample_inputs(seed, lengths=(3, 5, 2)):
    g = torch.Generator().manual_seed(seed)
    lp = [(-torch.rand(n, generator=g) * 2).requires_grad_() for n in lengths]
    old = [x.detach() + torch.randn(x.shape, generator=g) * 0.3 for x in lp]
    adv = [torch.randn(n, generator=g) for n in lengths]
    masks = [torch.ones(n) for n in lengths]
    return lp, old, adv, masks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_gradient_matches_loop(seed):
    lp, old, adv, masks = _sample_inputs(seed)
    out = get_policy_loss("ppo")(lp, old, adv, masks, _clip(0.2, 0.25, None))
    grads = torch.autograd.grad(torch.cat(out.loss).sum(), lp)
    ref_grads = torch.autograd.grad(_autograd_ref_ppo(lp, old, adv, 0.2, 0.25), lp)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps_lo,eps_hi", [(0.003, 0.004), (0.5, 0.6)])
def test_gspo_value_and_gradient_equal_sequence_objective(seed, eps_lo, eps_hi):
    lp, old, adv, masks = _sample_inputs(seed)
    masks[1][-1] = 0  # a masked token must not enter the sequence ratio
    adv = [torch.full_like(a, a[0].item()) for a in adv]  # GSPO advantages are per sequence
    out = get_policy_loss("gspo")(lp, old, adv, masks, _clip(eps_lo, eps_hi, None))
    # per-sample token mean of the GSPO-token loss ...
    objective = sum((loss * m).sum() / m.sum() for loss, m in zip(out.loss, masks))
    # ... equals (value and gradient) the sequence-level loop objective
    ref = 0
    for i, (x, o, a, m) in enumerate(zip(lp, old, adv, masks)):
        keep = [t for t in range(x.numel()) if m[t] > 0]
        s = torch.exp(sum(x[t] - o[t] for t in keep) / len(keep))
        ref = ref + torch.maximum(-a[0] * s, -a[0] * torch.clamp(s, 1 - eps_lo, 1 + eps_hi))
        # every token's ratio value is the sequence ratio
        seq_ratio = torch.exp(-out.ppo_kl[i])
        torch.testing.assert_close(seq_ratio, torch.full_like(seq_ratio, s.item()))
    torch.testing.assert_close(objective, ref)
    for a, b in zip(torch.autograd.grad(objective, lp), torch.autograd.grad(ref, lp)):
        torch.testing.assert_close(a, b)


def test_gspo_zero_kl_on_first_step():
    lp, _, adv, masks = _sample_inputs(4)
    out = get_policy_loss("gspo")(lp, [x.detach().clone() for x in lp], adv, masks, _clip(3e-3, 4e-3, None))
    assert torch.equal(torch.cat(out.ppo_kl), torch.zeros(10))
    assert torch.equal(torch.cat(out.loss), -torch.cat(adv))


def test_opsm_hand():
    lp = [torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(3)]
    behaviour = [
        torch.full((2,), 0.5),
        torch.full((2,), 0.5),
        torch.full((2,), 0.01),
        torch.tensor([0.5, 0.5, 9.0]),
    ]
    adv = [torch.full((2,), -1.0), torch.full((2,), 1.0), torch.full((2,), -1.0), torch.full((3,), -1.0)]
    masks = [torch.ones(2), torch.ones(2), torch.ones(2), torch.tensor([1.0, 1.0, 0.0])]
    keep = compute_opsm_mask(lp, behaviour, adv, masks, OPSM(delta=0.1))
    # 0: negative and far off-policy -> masked; 1: positive -> kept; 2: KL 0.01 <= delta -> kept;
    # 3: the masked 9.0 is ignored, mean KL 0.5 > delta -> masked
    assert [k.tolist() for k in keep] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("seed", [0, 1])
def test_opsm_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2, 5]
    lp = [-torch.rand(n, generator=g) for n in lengths]
    beh = [-torch.rand(n, generator=g) for n in lengths]
    adv = [torch.randn(n, generator=g) for n in lengths]
    masks = [(torch.rand(n, generator=g) > 0.2).float() for n in lengths]
    keep = compute_opsm_mask(lp, beh, adv, masks, OPSM(delta=0.05))
    for k, x, b, a, m in zip(keep, lp, beh, adv, masks):
        idx = [t for t in range(len(m)) if m[t] > 0]
        if idx:
            kl = sum(b[t].item() - x[t].item() for t in idx) / len(idx)
            mean_a = sum(a[t].item() for t in idx) / len(idx)
            expected = 0.0 if (mean_a < 0 and kl > 0.05) else 1.0
        else:
            expected = 1.0
        assert k.tolist() == [expected] * len(m)


def test_errors():
    with pytest.raises(ValueError, match="eps_clip_c=0.5 must be > 1"):
        _clip(0.2, 0.2, 0.5)
    with pytest.raises(ValueError, match="eps_clip=-0.1"):
        _clip(-0.1, 0.2)
    with pytest.raises(ValueError, match="shape"):
        compute_policy_loss(torch.zeros(2), torch.zeros(3), _clip(0.2, 0.2))
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'; choose one of"):
        get_policy_loss("ppo2")
    with pytest.raises(ValueError, match="policy loss 'ppo' is already registered"):
        register_policy_loss("ppo")
    with pytest.raises(ValueError, match="advantages\\[0\\] has shape"):
        get_policy_loss("ppo")(
            [torch.zeros(2)],
            [torch.zeros(2)],
            [torch.zeros(3)],
            [torch.ones(2)],
            _clip(0.2, 0.2, None),
        )
    with pytest.raises(ValueError, match="opsm_delta=-1"):
        OPSM(delta=-1)


@settings(max_examples=60, deadline=None)
@given(
    ppo_kl=st.lists(st.floats(-3, 3), min_size=1, max_size=8),
    adv_seed=st.integers(0, 2**16),
    eps_lo=st.floats(0.0, 0.9),
    eps_hi=st.floats(0.0, 2.0),
    eps_c=st.one_of(st.none(), st.floats(1.01, 10.0)),
)
def test_policy_loss_property(ppo_kl, adv_seed, eps_lo, eps_hi, eps_c):
    kl = torch.tensor(ppo_kl, dtype=torch.float64)
    adv = torch.randn(len(ppo_kl), generator=torch.Generator().manual_seed(adv_seed), dtype=torch.float64)
    loss, clip = compute_policy_loss(kl, adv, _clip(eps_lo, eps_hi, eps_c))
    ref_loss, ref_clip = _loop_ppo(kl.float(), adv.float(), eps_lo, eps_hi, eps_c)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    # the clip indicator may only disagree where the two terms tie up to float32 rounding
    ratio = torch.exp(-kl)
    tie = (ratio - ratio.clamp(1 - eps_lo, 1 + eps_hi)).abs() * adv.abs() < 1e-5
    assert torch.equal(clip[~tie], ref_clip[~tie])
    # the loss is never below the unclipped surrogate unless the dual clip capped it
    unclipped = (-adv * ratio).float()
    capped = (adv < 0) if eps_c is not None else torch.zeros_like(adv, dtype=torch.bool)
    assert torch.all((loss >= unclipped - 1e-5) | capped)
