"""TIS weights, MIS masks, mismatch metrics and the custom TIS hook against loop references."""

import math

import pytest
import torch

from miles.algo import (
    MIS,
    TIS,
    CustomMismatch,
    LossSettings,
    TISAndMIS,
    compute_mis_mask,
    compute_mismatch_weights,
    compute_tis_weights,
    finalize_metrics,
    metric,
)


def _inputs(seed, lengths=(4, 1, 6, 3)):
    g = torch.Generator().manual_seed(seed)
    old = [-torch.rand(n, generator=g) * 2 for n in lengths]
    rollout = [o + torch.randn(n, generator=g) * 0.6 for o, n in zip(old, lengths)]
    masks = [(torch.rand(n, generator=g) > 0.25).float() for n in lengths]
    masks[1][0] = 1.0
    return old, rollout, masks


def _kept(values, masks):
    return [v for vs, ms in zip(values, masks) for v, m in zip(vs, ms.tolist()) if m]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [(0.0, 2.0), (0.5, 1.5)])
def test_tis_weights_match_loop(seed, clip):
    old, rollout, _ = _inputs(seed)
    weights = compute_tis_weights(old, rollout, TIS(*clip))
    for w, o, r in zip(weights, old, rollout):
        expected = [min(max(math.exp(a - b), clip[0]), clip[1]) for a, b in zip(o.tolist(), r.tolist())]
        torch.testing.assert_close(w, torch.tensor(expected))
        assert not w.requires_grad


def test_tis_weights_detached():
    old = [torch.zeros(3, requires_grad=True)]
    w = compute_tis_weights(old, [torch.zeros(3)], TIS(0.0, 2.0))
    assert not w[0].requires_grad and torch.equal(w[0], torch.ones(3))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_mask_matches_loop(seed, level):
    old, rollout, masks = _inputs(seed)
    keep = compute_mis_mask(old, rollout, masks, MIS(level, 0.7, 1.4))
    for k, o, r, m in zip(keep, old, rollout, masks):
        diffs = [a - b for a, b in zip(o.tolist(), r.tolist())]
        if level == "token":  # values at mask-0 positions are never read: only loss tokens are compared
            expected = [1.0 if 0.7 <= math.exp(d) <= 1.4 else 0.0 for d in diffs]
            assert _kept([k.tolist()], [m]) == _kept([expected], [m])
        else:
            kept = [d for d, mm in zip(diffs, m.tolist()) if mm]
            geo = math.exp(sum(kept) / len(kept)) if kept else 1.0
            expected = [1.0 if 0.7 <= geo <= 1.4 else 0.0] * len(diffs)
            assert k.tolist() == expected


def test_mis_sequence_hand():
    old = [torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0])]
    rollout = [torch.tensor([-0.1, 0.1]), torch.tensor([-1.0, -1.0])]
    keep = compute_mis_mask(old, rollout, [torch.ones(2)] * 2, MIS("sequence", 0.5, 2.0))
    # sample 0: token ratios e^0.1, e^-0.1 but geometric mean 1 -> kept; sample 1: e^1 > 2 -> dropped
    assert [k.tolist() for k in keep] == [[1.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize("seed", [0, 1])
def test_mismatch_weights_and_metrics(seed):
    old, rollout, masks = _inputs(seed)
    weights, metrics = compute_mismatch_weights(
        old,
        rollout,
        masks,
        TISAndMIS(TIS(lo=0.5, hi=1.5), MIS(level="token", lo=0.4, hi=2.5)),
    )
    values = finalize_metrics(metrics)
    diffs = _kept([[a - b for a, b in zip(o.tolist(), r.tolist())] for o, r in zip(old, rollout)], masks)
    ratios = [math.exp(d) for d in diffs]
    assert values["train_rollout_logprob_abs_diff"] == pytest.approx(sum(abs(d) for d in diffs) / len(diffs))
    assert values["ois"] == pytest.approx(sum(ratios) / len(ratios))
    assert values["tis"] == pytest.approx(sum(min(max(x, 0.5), 1.5) for x in ratios) / len(ratios))
    assert values["tis_clipfrac"] == pytest.approx(sum(not 0.5 <= x <= 1.5 for x in ratios) / len(ratios))
    assert values["mis_masked_frac"] == pytest.approx(sum(not 0.4 <= x <= 2.5 for x in ratios) / len(ratios))
    for w, o, r, m in zip(weights, old, rollout, masks):
        expected = []
        for a, b in zip(o.tolist(), r.tolist()):
            x = math.exp(a - b)
            expected.append(min(max(x, 0.5), 1.5) if 0.4 <= x <= 2.5 else 0.0)
        keep = m != 0  # values at mask-0 positions are never read: only loss tokens are compared
        torch.testing.assert_close(w[keep], torch.tensor(expected)[keep])


def test_no_correction_gives_no_weights_but_metrics():
    old, rollout, masks = _inputs(0)
    weights, metrics = compute_mismatch_weights(old, rollout, masks, None)
    assert weights is None
    assert set(metrics) == {"train_rollout_logprob_abs_diff", "ois"}


def test_custom_tis_function():
    def half(old, rollout, masks, settings):
        weights = [torch.full(m.shape, 0.5) for m in masks]
        return weights, {"custom_count": metric(settings.entropy_coef, 1.0)}

    old, rollout, masks = _inputs(1)
    correction = CustomMismatch(half)
    settings = LossSettings(entropy_coef=7.0, mismatch=correction)
    weights, metrics = compute_mismatch_weights(old, rollout, masks, correction, settings)
    assert all(torch.equal(w, torch.full(m.shape, 0.5)) for w, m in zip(weights, masks))
    assert metrics["custom_count"].tolist() == [7.0, 1.0]
    assert "tis" not in metrics and "ois" in metrics
    with pytest.raises(ValueError, match="passes the LossSettings"):
        compute_mismatch_weights(old, rollout, masks, correction)


def test_errors():
    with pytest.raises(ValueError, match="tis_clip_low \\(3.0\\) <= tis_clip \\(2.0\\)"):
        TIS(3.0, 2.0)
    with pytest.raises(ValueError, match="mis_level='tok'"):
        MIS("tok", 0.5, 2.0)
    with pytest.raises(ValueError, match="mis_lower \\(2.0\\) <= mis_upper \\(1.0\\)"):
        MIS("token", 2.0, 1.0)
    with pytest.raises(ValueError, match="rollout_log_probs\\[0\\] has shape"):
        compute_mis_mask([torch.zeros(2)], [torch.zeros(1)], [torch.ones(2)], MIS("token", 0.5, 2.0))
