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


def input_tokens(model: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """[T] the tokens the model reads: a sequence whose last token is an image pad the policy sampled (the rollout
    stops on it, see docs/vlm.md) reads the text pad id there instead. The last token's own input changes no
    log-prob (its logits are not used); as an image pad it would claim image features the sample does not have."""
    tokens = packed.tokens.clone()
    last = packed.cu_seqlens[1:].long() - 1
    pad_id = getattr(model.config.get_text_config(), "pad_token_id", None) or 0
    trailing = last[(packed.response_lengths > 0) & (tokens[last] == model.config.image_token_id)]
    tokens[trailing] = pad_id
    return tokens


def mrope_position_ids(model: torch.nn.Module, packed: PackedBatch, images: PackedImages) -> torch.Tensor:
    """[3, T] long: each sequence's multimodal rotary positions (the model's `get_rope_index`), side by side."""
    inner = _inner(model)
    image_token_id = model.config.image_token_id
    bounds = packed.cu_seqlens.tolist()
    rows = []
    grid_start = 0
    all_tokens = input_tokens(model, packed)
    for j, n_img in enumerate(images.images_per_sequence):
        tokens = all_tokens[bounds[j] : bounds[j + 1]]
        if n_img == 0:
            rows.append(torch.arange(tokens.numel()).expand(3, -1))
            continue
        assert images.image_grid_thw is not None
        grid = images.image_grid_thw[grid_start : grid_start + n_img]
        grid_start += n_img
        token_types = (tokens == image_token_id).int()[None]
        pos, _ = inner.get_rope_index(tokens[None], mm_token_type_ids=token_types, image_grid_thw=grid)
        rows.append(pos[:, 0].cpu())
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
    model_tokens = input_tokens(model, packed).to(device)
    positions = packed.logit_positions().to(device)
    mrope = mrope_position_ids(model, packed, images).to(device)
    position_ids = torch.cat([packed.position_ids.to(device)[None], mrope])[:, None]  # [4, 1, T]
    extra = {}
    if images.pixel_values is not None:
        assert images.image_grid_thw is not None
        extra = {
            "pixel_values": images.pixel_values.to(device),
            "image_grid_thw": images.image_grid_thw.to(device),
        }
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
