"""Learning-rate schedule: linear warmup, then constant / linear / cosine decay to ``min_lr``.

Step ``s`` counts optimizer steps already taken (0 for the first). The learning rate used by step ``s`` is

    s < W:           lr * (s + 1) / W                               (warmup: lr/W on the first step, lr on step W-1)
    W <= s < D:      p = (s - W) / (D - W)
                     constant: lr
                     linear:   min_lr + (lr - min_lr) * (1 - p)
                     cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
    s >= D:          min_lr (lr for constant)

with W = warmup iterations and D = decay_iters (default: total_iters). Call `LRScheduler.step` once after every
``optimizer.step()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

DECAY_STYLES = ("constant", "linear", "cosine")


class LRScheduler:
    """Sets ``param_group["lr"]`` on every group of ``optimizer`` for the next optimizer step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr: float,
        min_lr: float,
        decay_style: str,
        warmup_iters: int,
        decay_iters: int,
    ) -> None:
        self.optimizer = optimizer
        self.lr = lr
        self.min_lr = min_lr
        self.decay_style = decay_style
        self.warmup_iters = warmup_iters
        self.decay_iters = decay_iters
        self.num_steps = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        """The learning rate used by optimizer step ``step`` (0-based)."""
        if step < self.warmup_iters:
            return self.lr * (step + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if step >= self.decay_iters:
            return self.min_lr
        progress = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - progress
        else:  # cosine
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * coeff

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self) -> None:
        """Advance by one optimizer step and set the learning rate of the next one."""
        self.num_steps += 1
        self._apply()

    def _apply(self) -> None:
        lr = self.lr_at(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, int | float | str]:
        return {
            "num_steps": self.num_steps,
            "lr": self.lr,
            "min_lr": self.min_lr,
            "decay_style": self.decay_style,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
        }

    def load_state_dict(self, state: Mapping[str, int | float | str]) -> None:
        """Restore the step counter. The schedule itself comes from the constructor (flags may change on
        resume, as with Megatron's override behaviour); only ``num_steps`` is taken from ``state``."""
        if "num_steps" not in state:
            raise ValueError(f"LR scheduler state has no 'num_steps' (keys: {sorted(state)})")
        self.num_steps = int(state["num_steps"])
        self._apply()


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    lr: float,
    min_lr: float = 0.0,
    decay_style: str = "constant",
    total_iters: int | None = None,
    warmup_iters: int = 0,
    warmup_fraction: float | None = None,
    decay_iters: int | None = None,
) -> LRScheduler:
    """Validate the schedule and build it. ``warmup_fraction`` (of ``total_iters``) and ``warmup_iters`` are
    alternatives; ``decay_iters`` defaults to ``total_iters`` (needed for linear/cosine decay)."""
    errors = []
    if decay_style not in DECAY_STYLES:
        errors.append(f"--lr-decay-style={decay_style!r} is not one of {DECAY_STYLES}")
    if lr < 0 or min_lr < 0:
        errors.append(f"--lr={lr} and --min-lr={min_lr} must be >= 0")
    if min_lr > lr:
        errors.append(f"--min-lr={min_lr} must be <= --lr={lr}")
    if warmup_iters < 0:
        errors.append(f"--lr-warmup-iters={warmup_iters} must be >= 0")
    if warmup_fraction is not None:
        if warmup_iters > 0:
            errors.append("--lr-warmup-iters and --lr-warmup-fraction are alternatives; set only one")
        if not 0.0 <= warmup_fraction <= 1.0:
            errors.append(f"--lr-warmup-fraction={warmup_fraction} must be in [0, 1]")
        if total_iters is None:
            errors.append("--lr-warmup-fraction needs the total number of training iterations")
    if decay_iters is None:
        decay_iters = total_iters
    if decay_style != "constant" and decay_iters is None:
        errors.append(f"--lr-decay-style={decay_style!r} needs --lr-decay-iters or the total iteration count")
    if errors:
        raise ValueError("invalid learning-rate schedule: " + "; ".join(errors))

    if warmup_fraction is not None:
        assert total_iters is not None  # an error above otherwise
        warmup_iters = int(warmup_fraction * total_iters)
    if decay_iters is None:
        decay_iters = warmup_iters  # constant schedule: unused
    if decay_style != "constant" and decay_iters <= warmup_iters:
        raise ValueError(
            f"invalid learning-rate schedule: decay iterations ({decay_iters}) must exceed warmup ({warmup_iters})"
        )
    return LRScheduler(optimizer, lr, min_lr, decay_style, warmup_iters, decay_iters)
