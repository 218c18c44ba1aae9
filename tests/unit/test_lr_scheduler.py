"""LR schedule curves against closed forms, state round-trip, validation."""

from __future__ import annotations

import math

import pytest
import torch

from miles.backends.fsdp_utils.lr_scheduler import build_lr_scheduler


def _opt(lr: float = 123.0) -> torch.optim.Optimizer:
    # two param groups: the schedule must drive both
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]}, {"params": [torch.zeros(1)]}], lr=lr
    )


def _run(sched, opt, n: int) -> list[float]:
    """The lr each of n optimizer steps sees (lr is read before the step, scheduler stepped after)."""
    seen = []
    for _ in range(n):
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs[0] == lrs[1]
        seen.append(lrs[0])
        opt.step()
        sched.step()
    return seen


def _expected(style: str, lr: float, min_lr: float, warmup: int, decay: int, n: int) -> list[float]:
    out = []
    for s in range(n):
        if s < warmup:
            out.append(lr * (s + 1) / warmup)
        elif style == "constant":
            out.append(lr)
        elif s >= decay:
            out.append(min_lr)
        else:
            p = (s - warmup) / (decay - warmup)
            if style == "linear":
                out.append(min_lr + (lr - min_lr) * (1 - p))
            else:
                out.append(min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * p)))
    return out


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_curves_match_closed_form(style: str, warmup: int) -> None:
    opt = _opt()
    sched = build_lr_scheduler(
        opt, lr=1e-3, min_lr=1e-5, decay_style=style, total_iters=20, warmup_iters=warmup
    )
    got = _run(sched, opt, 25)  # past the end: holds at min_lr (lr for constant)
    assert got == pytest.approx(_expected(style, 1e-3, 1e-5, warmup, 20, 25), rel=1e-12, abs=0)


def test_landmarks() -> None:
    opt = _opt()
    sched = build_lr_scheduler(opt, lr=1.0, min_lr=0.1, decay_style="cosine", total_iters=14, warmup_iters=4)
    got = _run(sched, opt, 16)
    assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # linear warmup, first step lr/W
    assert got[4] == pytest.approx(1.0)  # decay starts at lr
    assert got[9] == pytest.approx(0.55)  # half-way through cosine: (lr + min_lr) / 2
    assert got[14:] == pytest.approx([0.1, 0.1])


def test_warmup_fraction_and_decay_iters() -> None:
    opt = _opt()
    sched = build_lr_scheduler(
        opt, lr=2.0, min_lr=0.0, decay_style="linear", total_iters=100, warmup_fraction=0.1, decay_iters=30
    )
    assert sched.warmup_iters == 10 and sched.decay_iters == 30
    got = _run(sched, opt, 40)
    assert got == pytest.approx(_expected("linear", 2.0, 0.0, 10, 30, 40))


def test_state_dict_resumes_the_curve() -> None:
    opt = _opt()
    kwargs = dict(lr=1e-3, min_lr=1e-4, decay_style="cosine", total_iters=30, warmup_iters=5)
    sched = build_lr_scheduler(opt, **kwargs)
    first = _run(sched, opt, 12)
    state = sched.state_dict()
    rest = _run(sched, opt, 10)

    opt2 = _opt()
    sched2 = build_lr_scheduler(opt2, **kwargs)
    sched2.load_state_dict(state)
    assert _run(sched2, opt2, 10) == rest
    assert first + rest == pytest.approx(_expected("cosine", 1e-3, 1e-4, 5, 30, 22))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(decay_style="step"), "--lr-decay-style='step'"),
        (dict(min_lr=2.0), "--min-lr=2.0 must be <= --lr=1.0"),
        (dict(warmup_iters=-1), "--lr-warmup-iters=-1"),
        (dict(warmup_iters=2, warmup_fraction=0.1), "alternatives"),
        (dict(warmup_fraction=1.5), "--lr-warmup-fraction=1.5"),
        (dict(decay_style="linear", total_iters=None), "needs --lr-decay-iters"),
        (dict(decay_style="linear", warmup_iters=10), r"decay iterations \(10\) must exceed warmup \(10\)"),
    ],
)
def test_validation(kwargs: dict, match: str) -> None:
    args = dict(lr=1.0, min_lr=0.0, decay_style="constant", total_iters=10) | kwargs
    with pytest.raises(ValueError, match=match):
        build_lr_scheduler(_opt(), **args)
