"""The embedded engine's Qwen2.5-VL / Qwen3-VL path: model loading, request images, and the forward runner.

A request carries images as SGLang's `/generate` takes them (see `miles.rollout.vl_request`): `image_data`, a list
of images (data URIs, base64, paths) per prompt, and `input_ids` holding one `<|image_pad|>` per image. `VLInputs`
decodes them with the checkpoint's image processor and expands each pad to its image's merged-patch count, as
SGLang's processor does (the same count rule and error).

`VLRunner` runs the HF model itself: per slot, a request's first forward runs its whole sequence with
`pixel_values`/`image_grid_thw` and the multimodal rotary positions of the model's `get_rope_index` over its
prompt (the tokens after it, a sampled image pad included, are text: miles.utils.vl_positions), into an HF
`DynamicCache`; later forwards feed only the new tokens with the cache, at text positions shifted by the rope delta
(`max(position) + 1 - length`), which is how HF's generate continues. Positions are passed explicitly, so the
model's own `rope_deltas` attribute (one per model, not per request) is never used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from miles.engines.local.full_forward import NoCacheRunner
from miles.utils.vl_positions import (
    embeddings_read,
    image_region_end,
    mrope_positions,
    placeholder_free_ids,
    placeholder_ids,
    stray_placeholder_mask,
)

if TYPE_CHECKING:
    from miles.engines.local.scheduler import Batch
    from miles.rollout.multimodal import VLProcessor


def is_vl_checkpoint(path: str) -> bool:
    """Whether the HF directory `path` holds a vision-language model (its config.json has a `vision_config`)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return "vision_config" in json.load(f)


def load_model(path: str, dtype: torch.dtype, weights: bool = True) -> tuple[nn.Module, VLProcessor | None]:
    """The engine's HF model of `path` and, for a VL checkpoint, its image processing (`VLProcessor`).
    ``weights=False`` (an engine whose first refit brings its weights): a text model is built from its config
    alone, its parameters uninitialised (`unloaded_model`); a VL model, or one with persistent buffers, loads as
    usual."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if not is_vl_checkpoint(path):
        model = None if weights else unloaded_model(path, dtype)
        return model or AutoModelForCausalLM.from_pretrained(path, dtype=dtype), None
    from miles.rollout.multimodal import VLProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    return model, VLProcessor.from_pretrained(path, flag="--model-path")


def unloaded_model(path: str, dtype: torch.dtype) -> nn.Module | None:
    """The causal LM of `path` built from its config.json only: no weight is read or initialised (parameters on
    meta, then uninitialised CPU storage, `miles.utils.meta_init`), buffers computed by the constructors as
    `from_pretrained` computes them. None when the model has persistent buffers (the checkpoint holds those)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.utils.meta_init import has_persistent_buffers, materialize_parameters, parameters_on_meta

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    if has_persistent_buffers(model):
        return None
    materialize_parameters(model, "cpu")
    return model


@dataclass
class VLInputs:
    """One request's processed images, as the model's forward takes them."""

    pixel_values: torch.Tensor  # [P, D]
    image_grid_thw: torch.Tensor  # [N, 3]


def prepare_images(
    processor: VLProcessor, ids: list[int], images: Any, dtype: torch.dtype
) -> tuple[list[int], VLInputs | None]:
    """(expanded ids, processed images) of one prompt: `images` is the prompt's `image_data` entry (None, [] or a
    list of images; one image alone is taken as a list of one, as SGLang does)."""
    from miles.rollout.multimodal import load_image

    if images is None or images == []:
        items: list[Any] = []
    else:
        items = images if isinstance(images, list) else [images]
    pad = processor.image_token_id
    placeholders = sum(1 for t in ids if t == pad)
    if placeholders != len(items):
        raise ValueError(
            f"prompt has {placeholders} image placeholder token(s) but {len(items)} image(s) were provided"
        )
    if not items:
        return ids, None
    pil = [load_image(v, f"image_data[{i}]") for i, v in enumerate(items)]
    out = processor.image_processor(images=pil, return_tensors="pt")
    grid = out["image_grid_thw"].long()
    counts = iter((grid.prod(-1) // processor.merge_size**2).tolist())
    expanded: list[int] = []
    for t in ids:
        expanded.extend([pad] * next(counts) if t == pad else [t])
    return expanded, VLInputs(out["pixel_values"].to(dtype), grid)


@dataclass
class _SlotState:
    req: object  # the scheduler Request whose tokens the cache holds
    cache: Any  # transformers DynamicCache
    length: int  # tokens in the cache
    delta: int  # multimodal rope delta: a text token at index i sits at position i + delta


class VLRunner(NoCacheRunner):
    """Forward passes of a Qwen-VL HF model for the embedded engine (one HF cache per slot; the slot history
    and the rest of the runner interface as the no-cache runner's)."""

    uses_kv_cache = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.image_token_id = int(model.config.image_token_id)
        self.placeholders = placeholder_ids(model.config)
        self.merge_size = int(model.config.vision_config.spatial_merge_size)
        self.state: dict[int, _SlotState] = {}

    def release_kv(self) -> None:
        super().release_kv()
        self.state.clear()

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Extend each row's history; one forward per sampling row. Returns fp32 logits [rows, V]."""
        for src, dst, length in batch.moves:
            self.history[dst] = self.history[src][:length]
            moved = self.state.pop(src, None)
            if moved is not None and moved.length <= length:
                self.state[dst] = moved
            else:
                self.state.pop(dst, None)
        out = []
        for r in batch.rows:
            seq = self.history[r.slot] = self.history.get(r.slot, [])[: r.start] + list(r.token_ids)
            if r.sample:
                out.append(self._logits(r.slot, r.req, seq))
        return torch.stack(out)

    def _logits(self, slot: int, req: Any, seq: list[int]) -> torch.Tensor:
        device = self.model.device
        state = self.state.get(slot)
        new = seq[state.length :] if state is not None else []
        if state is None or state.req is not req or not new:
            return self._prefill(slot, req, seq)
        ids = torch.tensor([new], device=device)
        pos = torch.arange(state.length, len(seq), device=device) + state.delta
        out = self.model(
            input_ids=ids, position_ids=pos.expand(3, 1, -1), past_key_values=state.cache, use_cache=True
        )
        state.length = len(seq)
        return out.logits[0, -1].float()

    def _prefill(self, slot: int, req: Any, seq: list[int]) -> torch.Tensor:
        """The whole of `seq` into a fresh cache: 3-D positions from the request's image region (its prompt), the
        tokens after it (the outputs, even a sampled image pad) as text (miles.utils.vl_positions)."""
        from transformers import DynamicCache

        device = self.model.device
        mm: VLInputs | None = getattr(req, "mm", None)
        ids = torch.tensor(seq, device=device)
        extra: dict[str, torch.Tensor] = {}
        grid = None
        pads = 0
        if mm is not None:
            grid = mm.image_grid_thw.to(device)
            pads = int((grid.prod(-1) // self.merge_size**2).sum())
            extra = {"pixel_values": mm.pixel_values.to(device), "image_grid_thw": grid}
        region_end = image_region_end(ids, self.image_token_id, pads, len(getattr(req, "input_ids", seq)))
        pos = mrope_positions(self.model.model, ids, region_end, self.image_token_id, grid)
        starts = torch.tensor([0, len(seq)])
        stray = stray_placeholder_mask(ids, torch.tensor([region_end]), starts, self.placeholders)
        model_ids = placeholder_free_ids(ids, stray, self.placeholders) if bool(stray.any()) else ids
        cache = DynamicCache(config=self.model.config)
        with embeddings_read(self.model, ids if model_ids is not ids else None):
            out = self.model(
                input_ids=model_ids[None],
                position_ids=pos[:, None],
                past_key_values=cache,
                use_cache=True,
                **extra,
            )
        delta = int(pos.max()) + 1 - len(seq)
        self.state[slot] = _SlotState(req, cache, len(seq), delta)
        return out.logits[0, -1].float()
