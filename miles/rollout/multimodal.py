"""Images in prompt data: `--multimodal-keys`, loading images from sample fields, and the checkpoint's processor.

`--multimodal-keys '{"image": "images"}'` (the reference's flag, a JSON object) maps a modality to the dataset
field holding it; only "image" is supported. A field holds one image or a list of them, each a file path, a
`data:image/...;base64,` URI or bare base64 string, PIL-readable bytes, a PIL image, or an HF-datasets image dict
(`{"bytes": ..., "path": ...}`). URLs are refused: miles reads data offline. A bad image raises ValueError naming
the sample (its file:line, or index) and the field.

`VLProcessor` is what a Qwen-VL checkpoint's processor does for images, from the checkpoint's own tokenizer,
chat template and image processor (`AutoImageProcessor`: the PIL image processor when torchvision is absent). It
renders chat messages with one `{"type": "image"}` part per image, repeats the image pad token once per merged
patch, and returns the token ids with `pixel_values` and `image_grid_thw` (`MultimodalInputs`), which a `Sample`
carries to the trainer (`Sample.multimodal_inputs`).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.config.vl_rules import SUPPORTED_MODALITIES, parse_multimodal_keys

__all__ = [
    "SUPPORTED_MODALITIES",
    "MultimodalInputs",
    "VLProcessor",
    "image_data_uri",
    "images_of_sample",
    "load_image",
    "load_sample_images",
    "process_images",
    "parse_multimodal_keys",
]

if TYPE_CHECKING:
    import torch
    from PIL import Image

_URL_PREFIXES = ("http://", "https://", "ftp://", "s3://", "gs://")


def _decode_base64(text: str) -> bytes | None:
    body = text.split(",", 1)[1] if text.startswith("data:") else text
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        return None


def _image_bytes(value: Any, what: str) -> bytes | str:
    """Raw bytes of one image value, or a file path to open; ValueError (naming `what`) for what is not an image."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return _image_bytes(value["bytes"], what)
        if value.get("path") is not None:
            return _image_bytes(value["path"], what)
        raise ValueError(f"{what}: an image dict needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if not isinstance(value, str):
        raise ValueError(
            f"{what}: expected a path, base64 string, bytes or PIL image, got {type(value).__name__}"
        )
    if value.startswith(_URL_PREFIXES):
        raise ValueError(
            f"{what}: {value[:80]!r} is a URL; miles reads images offline (download it to a file)"
        )
    if value.startswith("data:"):
        data = _decode_base64(value)
        if data is None:
            raise ValueError(f"{what}: a data URI whose payload is not valid base64")
        return data
    if os.path.exists(value):
        return value
    data = _decode_base64(value) if len(value) > 64 else None  # short strings are (missing) paths
    if data is None:
        raise ValueError(f"{what}: no image file {value!r} (and not base64)")
    return data


def load_image(value: Any, what: str) -> Image.Image:
    """One image as an RGB PIL image; ValueError naming `what` (sample and field) when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    source = _image_bytes(value, what)
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        name = source if isinstance(source, str) else f"{len(source)} bytes"
        raise ValueError(f"{what}: cannot read the image ({name}): {type(e).__name__}: {e}") from None


def load_sample_images(row: dict[str, Any], keys: dict[str, str], where: str) -> list[Image.Image]:
    """The images of one dataset row (in field order, then list order); `where` names the row (file:line/index).

    A missing or null field gives no images; an empty list is allowed."""
    images: list[Image.Image] = []
    for modality, key in keys.items():
        raw = row.get(key)
        if raw is None:
            continue
        values = raw if isinstance(raw, list) else [raw]
        for j, value in enumerate(values):
            images.append(load_image(value, f"{where}: field {key!r} ({modality} {j})"))
    return images


def image_data_uri(image: Image.Image) -> str:
    """A PNG `data:image/png;base64,` URI of `image` (lossless: decoding it gives the same RGB pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def images_of_sample(multimodal_data: dict[str, list[str]] | None, what: str) -> list[Image.Image]:
    """The images of a `Sample.multimodal_data` (its "image" list, in order); `what` names the sample in errors."""
    if not multimodal_data:
        return []
    return [load_image(v, f"{what}: image {j}") for j, v in enumerate(multimodal_data.get("image", []))]


@dataclass
class MultimodalInputs:
    """The processed images of one sample, as the VL model's forward takes them."""

    pixel_values: torch.Tensor  # [P, C * temporal_patch * patch * patch] float32, P patches over all images
    image_grid_thw: torch.Tensor  # [N, 3] long, (t, h, w) patches of each of the N images

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def process_images(image_processor: Any, images: list[Image.Image]) -> MultimodalInputs | None:
    """`pixel_values` and `image_grid_thw` of `images` by `image_processor` (None when there are none)."""
    if not images:
        return None
    out = image_processor(images=images, return_tensors="pt")
    return MultimodalInputs(out["pixel_values"].float(), out["image_grid_thw"].long())


class VLProcessor:
    """A Qwen-VL checkpoint's prompt processing for images: chat template + image processor + pad expansion."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token: str = "<|image_pad|>") -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"the tokenizer has no image token {image_token!r}; is this a Qwen-VL checkpoint?"
            )
        self.merge_size = int(image_processor.merge_size)

    @classmethod
    def from_pretrained(cls, path: str, flag: str = "--hf-checkpoint") -> VLProcessor:
        """The processor of the HF directory `path` (its tokenizer and `AutoImageProcessor`)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
            image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{flag}={path!r}: cannot load the tokenizer/image processor: {e}") from e
        return cls(tokenizer, image_processor)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, flag: str = "--hf-checkpoint") -> VLProcessor:
        """The processor of the checkpoint `tokenizer` was loaded from (its image processor from the same
        directory, `tokenizer.name_or_path`)."""
        from transformers import AutoImageProcessor

        path = tokenizer.name_or_path
        try:
            image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{flag}={path!r}: cannot load the image processor: {e}") from e
        return cls(tokenizer, image_processor)

    def process_images(self, images: list[Image.Image]) -> MultimodalInputs | None:
        """`pixel_values` and `image_grid_thw` of `images` (None for none): what the trainer feeds the model."""
        return process_images(self.image_processor, images)

    def image_messages(self, prompt: str | list[dict[str, Any]], num_images: int) -> list[dict[str, Any]]:
        """Chat messages with the images placed: a string prompt, or a first user message whose content is a
        string, gets `num_images` image parts before its text; messages that already hold image parts keep them
        (their count must match the images)."""
        messages: list[dict[str, Any]] = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        )
        placed = sum(
            1
            for m in messages
            if isinstance(m["content"], list)
            for c in m["content"]
            if c.get("type") == "image"
        )
        if placed:
            if placed != num_images:
                raise ValueError(
                    f"the messages hold {placed} image parts but the sample has {num_images} images"
                )
            return messages
        if num_images:
            first = next(i for i, m in enumerate(messages) if m["role"] == "user")
            text = messages[first]["content"]
            parts = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
            messages[first] = {**messages[first], "content": parts}
        return messages

    def encode(
        self, prompt: str | list[dict[str, Any]], images: list[Image.Image]
    ) -> tuple[list[int], MultimodalInputs | None]:
        """(prompt token ids, processed images or None) of a prompt with its images, with a generation prompt."""
        messages = self.image_messages(prompt, len(images))
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        mm = self.process_images(images)
        ids = self.tokenizer(self.expand_pads(text, mm), add_special_tokens=False)["input_ids"]
        return list(ids), mm

    def expand_pads(self, text: str, mm: MultimodalInputs | None) -> str:
        """`text` (one image token per image, as the chat template places them) with each image token repeated
        once per merged patch of its image (`mm`, in order; None: no images, `text` unchanged)."""
        if mm is None:
            return text
        counts = (mm.image_grid_thw.prod(-1) // self.merge_size**2).tolist()
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts):
            raise ValueError(
                f"the chat template placed {len(pieces) - 1} image tokens for {len(counts)} images"
            )
        return pieces[0] + "".join(self.image_token * n + p for n, p in zip(counts, pieces[1:]))
