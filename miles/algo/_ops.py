"""Private helpers for per-sample token lists (`list[Tensor[L_i]]`), the layout every algo function takes.

The backend unpacks its packed micro-batch into one 1-D tensor per sample; here those lists are concatenated
for vectorised math and split back, and per-sample masked sums are taken with index_add (differentiable).

Masking rule of the whole package: a value at a loss-mask-0 position is never read. Masked values are removed
by SELECTING with the mask (`masked`, `masked_list`), never by multiplying with it: ``nan * 0`` is nan, and a
value that was multiplied away still sends ``0 * inf = nan`` back through the backward pass of whatever
produced it. Selection before any nonlinearity keeps both the forward values and the gradients finite.
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


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """`values * mask` where mask != 0 and exactly 0 elsewhere, whatever `values` holds there (nan, inf).

    The gradient w.r.t. `values` is `mask` at kept positions and exactly 0 at masked ones."""
    kept = values * mask.to(values.dtype)
    return torch.where(mask != 0, kept, torch.zeros((), dtype=kept.dtype, device=kept.device))


def masked_cat(values: list[Tensor], masks: list[Tensor]) -> Tensor:
    """`cat(values)` with 0 at every mask-0 position (selected: nan/inf there never get through)."""
    flat = cat(values)
    return torch.where(cat(masks) != 0, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))


def masked_list(values: list[Tensor], masks: list[Tensor]) -> list[Tensor]:
    """`masked` per sample; positions with mask 0 become 0 (use before exp, log, division or a reduction).

    One `where` over the concatenated samples, split back into views (the same values as a `where` per sample,
    with one autograd node per micro-batch instead of one per sample)."""
    if not values:
        return []
    return split(masked_cat(values, masks), lengths_of(values))


def per_sample_sum(flat: Tensor, lengths: list[int]) -> Tensor:
    """Tensor[B]: sum of `flat` over each sample's tokens (differentiable)."""
    out = torch.zeros(len(lengths), dtype=flat.dtype, device=flat.device)
    return out.index_add(0, sample_ids(lengths, flat.device), flat)


def per_sample_masked_mean(flat: Tensor, flat_mask: Tensor, lengths: list[int]) -> Tensor:
    """Tensor[B]: each sample's mean of `flat` over its mask==1 tokens; 0 for a sample with no such token."""
    num = per_sample_sum(masked(flat, flat_mask), lengths)
    den = per_sample_sum(flat_mask.to(flat.dtype), lengths)
    return num / den.clamp(min=1.0)
