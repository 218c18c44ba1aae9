"""The FSDP2 trainer's side of vision-language RL (issue 27): the images of a rank's samples, the packed forward
that carries them, and freezing the vision tower.

A `Sample` brings its prompt's images as PNG data URIs (`Sample.multimodal_data`, set by the data source from
--multimodal-keys); the trainer re-processes them with the checkpoint's own image processor into `pixel_values` and
`image_grid_thw` (`sample_images`, once per train call), which are what the data source's processor computed for
the same images (PNG is lossless). `forward_pack` runs a pack through `forward_packed_vl` when the model is a
Qwen-VL model (a text-only sample in it gets text positions), else through the text `forward_packed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from miles.backends.fsdp_utils.vl_packing import forward_packed_vl, is_vl_model, pack_images, vision_tower

if TYPE_CHECKING:
    from miles.backends.fsdp_utils.context_parallel import CPContext
    from miles.backends.fsdp_utils.data_packing import PackedBatch
    from miles.rollout.multimodal import MultimodalInputs
    from miles.utils.types import Sample

__all__ = ["forward_pack", "freeze_vision_tower", "load_image_processor", "sample_images"]


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """--freeze-vision-tower: the vision tower's parameters stop requiring grad (so the optimizer, built from the
    parameters that do, never holds them); returns how many parameters were frozen."""
    params = list(vision_tower(model).parameters())
    for p in params:
        p.requires_grad_(False)
    return len(params)


def load_image_processor(path: str, flag: str = "--hf-checkpoint") -> Any:
    """The image processor of the HF directory `path` (the PIL one when torchvision is absent)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}={path!r}: cannot load the image processor: {e}") from e


def sample_images(samples: Sequence[Sample], image_processor: Any) -> list[MultimodalInputs | None]:
    """Each sample's processed images (None for a sample without images), from its `multimodal_data`."""
    from miles.rollout.multimodal import images_of_sample, process_images

    out: list[MultimodalInputs | None] = []
    for s in samples:
        images = images_of_sample(s.multimodal_data, f"training batch: sample index {s.index}")
        out.append(process_images(image_processor, images))
    return out


def forward_pack(
    model: torch.nn.Module,
    packed: PackedBatch,
    images: list[MultimodalInputs | None] | None,
    temperature: float,
    cp: CPContext | None,
    with_entropy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The pack's log-probs (and entropy): `forward_packed_vl` for a Qwen-VL model, with `images` the processed
    images of the pack's sequences in pack order (None: none has any); else `forward_packed`."""
    if not is_vl_model(model):
        from miles.backends.fsdp_utils.forward import forward_packed

        return forward_packed(model, packed, temperature, cp=cp, with_entropy=with_entropy)
    if cp is not None and cp.size > 1:
        raise ValueError("--context-parallel-size > 1 is not supported for vision-language models (issue 27)")
    # pack_images reads sample `sample_indices[j]` for the pack's j-th sequence: place each at that index
    index = packed.sample_indices.tolist()
    rows: list[dict[str, MultimodalInputs | None]] = [
        {"multimodal_inputs": None} for _ in range(max(index) + 1)
    ]
    for j, mm in enumerate(images or []):
        rows[index[j]] = {"multimodal_inputs": mm}
    return forward_packed_vl(model, packed, pack_images(packed, rows), temperature, with_entropy=with_entropy)
