"""Multimodal rotary positions and image placeholders of a Qwen-VL sequence, shared by the embedded engine's VL
runner and the trainer's packed VL forward, so both read a sequence the same way (issue 27).

A sequence's images sit in its image region: the prompt, and beyond it (multi-turn tool results) up to its last
real image pad. The 3-D positions of that region are the model's `get_rope_index`; every later token is text at
its index plus the rope delta (`max(position) + 1 - region length`), which is how SGLang positions decode tokens
(`mrope_position_delta + seq_len - 1`). An image pad (or video pad) token the policy sampled after the region is
text as well: it keeps its own embedding and claims no image features, as in SGLang's decode, where a sampled
token is only embedded. HF's forward takes every image pad of `input_ids` as a placeholder, so such a pad is
given to the model as another id (`placeholder_free_ids`) while the embedding layer still reads the true id
(`embeddings_read`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def placeholder_ids(config: object) -> tuple[int, ...]:
    """The image (and video) pad ids of a Qwen-VL config."""
    ids = [getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)]
    return tuple(int(i) for i in ids if i is not None)


def image_region_end(tokens: torch.Tensor, image_token_id: int, image_pads: int, prompt_len: int) -> int:
    """Where the image region of `tokens` ([L]) ends: after its prompt and after its first `image_pads` image
    pad tokens (the ones its images fill)."""
    if image_pads <= 0:
        return prompt_len
    where = (tokens == image_token_id).nonzero().flatten()
    if where.numel() < image_pads:
        raise ValueError(
            f"the sequence has {where.numel()} image pad tokens but its images fill {image_pads}"
        )
    return max(prompt_len, int(where[image_pads - 1]) + 1)


def mrope_positions(
    inner: nn.Module, tokens: torch.Tensor, region_end: int, image_token_id: int, grid: torch.Tensor | None
) -> torch.Tensor:
    """[3, L] long: `get_rope_index` over `tokens[:region_end]` (its images' `grid`, None for none), then text
    positions shifted by the rope delta."""
    n = tokens.numel()
    if grid is None or grid.numel() == 0:
        return torch.arange(n, device=tokens.device).expand(3, -1)
    region = tokens[:region_end][None]
    types = (region == image_token_id).int()
    pos, _ = inner.get_rope_index(region, mm_token_type_ids=types, image_grid_thw=grid)
    pos = pos[:, 0].to(tokens.device)
    delta = int(pos.max()) + 1 - region_end
    rest = torch.arange(region_end, n, device=tokens.device) + delta
    return torch.cat([pos, rest.expand(3, -1)], dim=1)


def stray_placeholder_mask(
    tokens: torch.Tensor, region_ends: torch.Tensor, starts: torch.Tensor, ids: tuple[int, ...]
) -> torch.Tensor:
    """[T] bool: the image/video pad tokens of a row of sequences (sequence j spans `starts[j]:starts[j+1]`) that
    lie after their sequence's image region (`region_ends[j]`, relative to its start)."""
    index = torch.arange(tokens.numel(), device=tokens.device)
    seq = torch.bucketize(index, starts[1:].to(tokens.device), right=True)
    after = index - starts.to(tokens.device)[seq] >= region_ends.to(tokens.device)[seq]
    return after & torch.isin(tokens, torch.tensor(ids, device=tokens.device))


def placeholder_free_ids(tokens: torch.Tensor, stray: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    """`tokens` with the stray pads (`stray`) replaced by an id that is no placeholder (the embedding layer is
    given the true ids, see `embeddings_read`)."""
    other = next(i for i in range(len(ids) + 1) if i not in ids)
    return torch.where(stray, torch.full_like(tokens, other), tokens)


@contextmanager
def embeddings_read(model: nn.Module, true_ids: torch.Tensor | None) -> Iterator[None]:
    """Within it, the model's input embedding layer embeds `true_ids` (shaped as its input) instead of the ids it
    is called with; None: no change."""
    if true_ids is None:
        yield
        return
    embed = model.get_input_embeddings()

    def swap(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (true_ids.reshape(args[0].shape).to(args[0].device), *args[1:])

    handle = embed.register_forward_pre_hook(swap)
    try:
        yield
    finally:
        handle.remove()
