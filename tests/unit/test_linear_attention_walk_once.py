"""`segment_linear_attention` runs before every packed forward: it walks the model's modules once, then answers
from the count it kept on the model (the same count, with and without linear-attention layers)."""

from __future__ import annotations

import torch
from torch import nn

import miles.backends.fsdp_utils.linear_attention as la


def test_modules_walked_once_per_model(monkeypatch):
    walks = []
    real = la.linear_attention_layers

    def counting(model: nn.Module) -> list[nn.Module]:
        walks.append(model)
        return real(model)

    monkeypatch.setattr(la, "linear_attention_layers", counting)
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert [la.segment_linear_attention(plain) for _ in range(3)] == [0, 0, 0]
    assert walks == [plain]

    fake = type(sorted(la.LINEAR_ATTENTION_CLASS_NAMES)[0], (nn.Module,), {"forward": lambda self, x: x})
    hybrid = nn.Sequential(fake(), nn.Linear(2, 2), fake())
    hybrid.register_parameter("w", nn.Parameter(torch.zeros(1)))
    assert [la.segment_linear_attention(hybrid) for _ in range(2)] == [2, 2]
    assert walks == [plain, hybrid]
    assert all(getattr(m, la._SEGMENTED, False) for m in (hybrid[0], hybrid[2]))
