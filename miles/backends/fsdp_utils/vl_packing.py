"""Packed forwards of Qwen2.5-VL / Qwen3-VL models: each sample's images travel with it into its pack.

A pack of a VL model carries, beside the token row, its sequences' processed images (`PackedImages`): the pixel
values of every image of every sequence concatenated in pack order, their `image_grid_thw` rows in the same order,
and the multimodal rotary ("mrope") position ids, computed per sequence by the model's own `get_rope_index` and
laid side by side: [3, T] (temporal, height, width). A sequence without images gets the text positions 0..L-1 on
all three rows, as the model gives a text-only sequence.

The model is called with 4-row position ids ([text positions; mrope rows]); the text row restarts at 0 at every
sequence and gives "miles_varlen" attention its sequence boundaries (no `cu_seq_lens_q` kwarg is passed, since
the model hands its extra kwargs on to the vision tower too). The vision tower keeps its own attention (it attends
within each image, so images of different sequences never mix), and the decoder layers run "miles_varlen".
Image features replace the image pad tokens in row order, which is pack order, which is the order of
`pixel_values`: so the pack computes what each sequence's own forward computes (checked to 1e-5 in fp32 by
tests/unit/test_vl_packing.py, forward and backward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.algo.logprobs import log_probs_and_entropy
from miles.backends.fsdp_utils.data_packing import PackedBatch, unpack_sequences
from miles.backends.fsdp_utils.packed_attention import VARLEN_ATTENTION
from miles.utils.vl_positions import (
    embeddings_read,
    image_region_end,
    mrope_positions,
    placeholder_free_ids,
    placeholder_ids,
    stray_placeholder_mask,
)

__all__ = ["PackedImages", "forward_packed_vl", "is_vl_model", "pack_images", "vision_tower"]


@dataclass
class PackedImages:
    """The images of one pack's sequences, in pack order."""

    pixel_values: torch.Tensor | None  # [P, D] float, None when no sequence of the pack has an image
    image_grid_thw: torch.Tensor | None  # [N, 3] long
    images_per_sequence: list[int]  # [n]


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The `...VLModel` inside a `...ForConditionalGeneration` (which holds `visual` and `language_model`)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "visual") or not hasattr(inner, "get_rope_index"):
        raise ValueError(f"{type(model).__name__} is not a Qwen-VL model (no .model.visual / get_rope_index)")
    return inner


def is_vl_model(model: torch.nn.Module) -> bool:
    """Whether `model` is a Qwen-VL-style image-text model this module can pack."""
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "visual") and hasattr(inner, "get_rope_index")


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower (patch embedding, blocks, merger) of a Qwen-VL model."""
    return _inner(model).visual


def _field(sample: object, name: str) -> Any:
    return sample.get(name) if isinstance(sample, Mapping) else getattr(sample, name, None)


def pack_images(packed: PackedBatch, samples: Sequence[object]) -> PackedImages:
    """The `PackedImages` of `packed`, read from the samples it was packed from (`samples`, the list given to
    `pack_sequences`). A sample's images are its `multimodal_inputs` (a `MultimodalInputs`, or a dict with
    `pixel_values` and `image_grid_thw`); None or absent means no image."""
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    counts: list[int] = []
    for i in packed.sample_indices.tolist():
        mm = _field(samples[i], "multimodal_inputs")
        if mm is None:
            counts.append(0)
            continue
        pv, grid = _field(mm, "pixel_values"), _field(mm, "image_grid_thw")
        if pv is None or grid is None or grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"sample {i}: multimodal_inputs needs pixel_values and image_grid_thw [N, 3]")
        if int(grid.prod(-1).sum()) != pv.shape[0]:
            raise ValueError(
                f"sample {i}: image_grid_thw covers {int(grid.prod(-1).sum())} patches, pixel_values has {pv.shape[0]}"
            )
        pixels.append(pv)
        grids.append(grid.long())
        counts.append(int(grid.shape[0]))
    if not pixels:
        return PackedImages(None, None, counts)
    return PackedImages(torch.cat(pixels), torch.cat(grids), counts)


def image_regions(model: torch.nn.Module, packed: PackedBatch, images: PackedImages) -> torch.Tensor:
    """[n] long: where each sequence's image region ends (relative to its start; see miles.utils.vl_positions):
    after its prompt and after the image pads its own images fill."""
    merge = int(model.config.vision_config.spatial_merge_size)
    image_token_id = model.config.image_token_id
    bounds = packed.cu_seqlens.tolist()
    ends = []
    grid_start = 0
    for j, n_img in enumerate(images.images_per_sequence):
        prompt_len = int(packed.prompt_lengths[j])
        pads = 0
        if n_img:
            assert images.image_grid_thw is not None
            grid = images.image_grid_thw[grid_start : grid_start + n_img]
            grid_start += n_img
            pads = int((grid.prod(-1) // merge**2).sum())
        tokens = packed.tokens[bounds[j] : bounds[j + 1]]
        ends.append(image_region_end(tokens, image_token_id, pads, prompt_len))
    return torch.tensor(ends, dtype=torch.long)


def mrope_position_ids(model: torch.nn.Module, packed: PackedBatch, images: PackedImages) -> torch.Tensor:
    """[3, T] long: each sequence's multimodal rotary positions (the model's `get_rope_index` over its image
    region, text positions after it), side by side."""
    inner = _inner(model)
    bounds = packed.cu_seqlens.tolist()
    ends = image_regions(model, packed, images).tolist()
    rows = []
    grid_start = 0
    for j, n_img in enumerate(images.images_per_sequence):
        grid = None
        if n_img:
            assert images.image_grid_thw is not None
            grid = images.image_grid_thw[grid_start : grid_start + n_img]
            grid_start += n_img
        tokens = packed.tokens[bounds[j] : bounds[j + 1]]
        rows.append(mrope_positions(inner, tokens, ends[j], model.config.image_token_id, grid).cpu())
    return torch.cat(rows, dim=1)


def enable_vl_varlen_attention(model: torch.nn.Module) -> None:
    """ "miles_varlen" for the decoder layers (text config); the vision tower keeps its own attention."""
    if model.config.text_config._attn_implementation != VARLEN_ATTENTION:
        model.set_attn_implementation({"text_config": VARLEN_ATTENTION})


def forward_packed_vl(
    model: torch.nn.Module,
    packed: PackedBatch,
    images: PackedImages,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """`forward_packed` for a Qwen-VL model: log-probs (and entropy) of every response token of every sequence.

    Same contract as `forward_packed` (scored rows only through the LM head, fp32 log-probs, differentiable);
    no context parallelism (refused at validation for VL checkpoints, issue 27)."""
    if packed.num_sequences == 0:
        raise ValueError("forward_packed_vl got an empty pack (no sequences)")
    if len(images.images_per_sequence) != packed.num_sequences:
        raise ValueError(
            f"the pack has {packed.num_sequences} sequences but its images cover {len(images.images_per_sequence)}"
        )
    enable_vl_varlen_attention(model)
    device = next(model.parameters()).device
    tokens = packed.tokens.to(device)
    positions = packed.logit_positions().to(device)
    mrope = mrope_position_ids(model, packed, images).to(device)
    ids = placeholder_ids(model.config)
    stray = stray_placeholder_mask(tokens, image_regions(model, packed, images), packed.cu_seqlens, ids)
    model_tokens = placeholder_free_ids(tokens, stray, ids) if bool(stray.any()) else tokens
    position_ids = torch.cat([packed.position_ids.to(device)[None], mrope])[:, None]  # [4, 1, T]
    extra = {}
    if images.pixel_values is not None:
        assert images.image_grid_thw is not None
        extra = {
            "pixel_values": images.pixel_values.to(device),
            "image_grid_thw": images.image_grid_thw.to(device),
        }
    with embeddings_read(model, tokens if model_tokens is not tokens else None):
        out = model(
            input_ids=model_tokens[None],
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=positions,
            **extra,
        )
    log_probs, entropy = log_probs_and_entropy(
        out.logits[0], tokens.index_select(0, positions + 1), temperature, with_entropy
    )
    lp_list = unpack_sequences(log_probs, packed)
    ent_list = unpack_sequences(entropy, packed) if entropy is not None else None
    return lp_list, ent_list
