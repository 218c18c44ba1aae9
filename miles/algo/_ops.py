"""Private helpers for per-sample token lists (`list[Tensor[L_i]]`), the layout every algo function takes.

The backend unpacks its packed micro-batch into one 1-D tensor per sample; here those lists are concatenated
for vectorised math and split back, and per-sample masked sums are taken with index_add (differentiable).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_aligned(name: str, values: list[Tensor], ref: list[Tensor], ref_name: str = "loss_masks") -> None:
    """Raise ValueError unless `values` has one 1-D tensor per sample with the same length as `ref`."""
    if len(values) != len(ref):
        raise ValueError(f"{name} has {len(values)} samples but {ref_name} has {len(ref)}")
    for i, (v, r) in enumerate(zip(values, ref)):
        if v.dim() != 1 or v.shape != r.shape:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(v.shape)} but {ref_name}[{i}] has shape {tuple(r.shape)}"
            )


def lengths_of(values: list[Tensor]) -> list[int]:
    return [int(v.numel()) for v in values]


def cat(values: list[Tensor]) -> Tensor:
    """Concatenate per-sample 1-D tensors (an empty list gives an empty float tensor)."""
    if not values:
        return torch.zeros(0)
    return torch.cat(values)


def split(flat: Tensor, lengths: list[int]) -> list[Tensor]:
    return list(torch.split(flat, lengths))


def sample_ids(lengths: list[int], device: torch.device) -> Tensor:
    """Tensor[sum(lengths)] giving, for each concatenated token, the index of its sample."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device, dtype=torch.long)
    )


def per_sample_sum(flat: Tensor, lengths: list[int]) -> Tensor:
    """Tensor[B]: sum of `flat` over each sample's tokens (differentiable)."""
    out = torch.zeros(len(lengths), dtype=flat.dtype, device=flat.device)
    return out.index_add(0, sample_ids(lengths, flat.device), flat)


def per_sample_masked_mean(flat: Tensor, flat_mask: Tensor, lengths: list[int]) -> Tensor:
    """Tensor[B]: each sample's mean of `flat` over its mask==1 tokens; 0 for a sample with no such token."""
    mask = flat_mask.to(flat.dtype)
    num = per_sample_sum(flat * mask, lengths)
    den = per_sample_sum(mask, lengths)
    return num / den.clamp(min=1.0)
