"""KL estimators against a per-element loop reference and hand values."""

import math

import pytest
import torch

from miles.algo import KL_TYPES, compute_approx_kl


def _ref(lp: float, ref: float, kl_type: str) -> float:
    d = lp - ref
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "k3":
        return math.exp(-d) - 1 + d
    d = min(max(d, -20.0), 20.0)
    return min(max(math.exp(-d) - 1 + d, -10.0), 10.0)


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop(kl_type, seed):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(17, generator=g) * 3
    ref = -torch.rand(17, generator=g) * 3
    out = compute_approx_kl(lp, ref, kl_type)
    expected = torch.tensor([_ref(a, b, kl_type) for a, b in zip(lp.tolist(), ref.tolist())])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_hand_values():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    d = math.log(2.0)
    assert compute_approx_kl(lp, ref, "k1").item() == pytest.approx(d)
    assert compute_approx_kl(lp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert compute_approx_kl(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)


def test_identical_policies_give_zero():
    lp = torch.randn(9)
    for kl_type in KL_TYPES:
        assert torch.equal(compute_approx_kl(lp, lp.clone(), kl_type), torch.zeros(9))


def test_low_var_kl_clamped_and_finite_gradient():
    lp = torch.tensor([0.0, -200.0, -1.0], requires_grad=True)
    ref = torch.tensor([-200.0, 0.0, -1.0])
    kl = compute_approx_kl(lp, ref, "low_var_kl")
    assert kl[0].item() == 10.0  # k3 would be ~199: clamped at 10
    assert kl[1].item() == 10.0  # exp(200) overflows without the log-ratio clamp
    assert kl[2].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_unbiased_weight():
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(8, generator=g)
    old = torch.randn(8, generator=g)
    ref = torch.randn(8, generator=g)
    plain = compute_approx_kl(lp, ref, "k3")
    weighted = compute_approx_kl(lp, ref, "k3", old_log_probs=old)
    torch.testing.assert_close(weighted, plain * torch.exp(lp - old))
    assert torch.equal(compute_approx_kl(lp, ref, "k3", old_log_probs=lp.clone()), plain)


def test_unbiased_weight_carries_gradient():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    compute_approx_kl(lp, ref, "k1", old_log_probs=lp.detach().clone()).sum().backward()
    # d/dlp [exp(lp - old) * (lp - ref)] at lp == old = (lp - ref) + 1
    torch.testing.assert_close(lp.grad, torch.tensor([0.5 + 1, -1.0 + 1]))


def test_errors():
    with pytest.raises(
        ValueError, match=r"unknown kl_type 'k4'; choose one of \['k1', 'k2', 'k3', 'low_var_kl'\]"
    ):
        compute_approx_kl(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="shape"):
        compute_approx_kl(torch.zeros(2), torch.zeros(3), "k1")
