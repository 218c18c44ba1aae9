"""User extension points as a user would write them, loaded by path in the trainer tests."""

from __future__ import annotations

import torch

from miles.algo import AdvantageInputs, AdvantageOutputs, LossInputs, LossSettings, compute_loss, metric


def sign_advantage(inputs: AdvantageInputs) -> AdvantageOutputs:
    """+1 for rewards above the batch mean, -1 below, on every token."""
    signs = torch.sign(inputs.rewards - inputs.rewards.mean())
    adv = [torch.full_like(m, float(s)) for m, s in zip(inputs.loss_masks, signs)]
    return AdvantageOutputs(advantages=adv, returns=[a.clone() for a in adv])


def half_weights(old, rollout, masks, settings):
    """A constant 0.5 importance weight, reported as `custom_weight`."""
    weights = [torch.full_like(m, 0.5) for m in masks]
    return weights, {
        "custom_weight": metric(0.5 * sum(float(m.sum()) for m in masks), sum(float(m.sum()) for m in masks))
    }


def doubled_loss(inputs: LossInputs, settings: LossSettings):
    loss, metrics = compute_loss(inputs, settings)
    metrics["doubled"] = metric(1.0, 1.0)
    return 2 * loss, metrics


def first_token_even(args, sample) -> float:
    """1 when the first response token id is even: a random policy scores about half, so every prompt group
    has a reward spread and the first update is never a no-op."""
    return float(sample.response_length > 0 and sample.tokens[-sample.response_length] % 2 == 0)
