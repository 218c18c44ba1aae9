"""Tiny, randomly initialised Qwen2.5-VL and Qwen3-VL models with a tokenizer and an image processor (CPU tests).

`build_tiny_vlm(out, kind)` writes an HF directory that loads offline with
`AutoModelForImageTextToText.from_pretrained(out)`, `AutoTokenizer.from_pretrained(out)` and
`AutoImageProcessor.from_pretrained(out)` (the PIL image processor when torchvision is absent, which is the tested
path here). `AutoProcessor` also works where torchvision is installed (the Qwen-VL processors need it for their
video processor); miles' own `miles.rollout.multimodal.VLProcessor` needs only the tokenizer and image processor.

The tokenizer is `tiny_model.build_tokenizer`'s byte-level BPE plus the vision tokens `<|vision_start|>`,
`<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`; its chat template renders a message whose content is a list
of parts as `<|vision_start|><|image_pad|><|vision_end|>` per `{"type": "image"}` part and the text of
`{"type": "text"}` parts (the Qwen-VL layout; the processor then repeats `<|image_pad|>` once per merged patch).
The vision tower is 2 blocks of width 32 with the real patch geometry (14-pixel patches, 2x2 merge, temporal patch
2), and the image processor keeps images between 56x56 and 112x112 pixels: 4 to 16 image tokens per image.

    python -m miles.tools.tiny_vlm --out /tmp/tiny-vl --kind qwen2_5_vl
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from miles.tools.tiny_model import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_tokenizer,
    save_model_dir,
)
from miles.tools.toy_data import DEFAULT_TASK

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

VLKind = Literal["qwen2_5_vl", "qwen3_vl"]
VL_KINDS: tuple[str, ...] = get_args(VLKind)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}" + IM_START + "{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}" + VISION_START + IMAGE_PAD + VISION_END + "{% else %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}" + IM_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
_PROCESSOR_CLASS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def build_vl_tokenizer(task: str = DEFAULT_TASK, vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """The toy task's BPE tokenizer with the four vision tokens and the Qwen-VL chat template."""
    tok = build_tokenizer(task, vocab_size, extra_special_tokens=VISION_TOKENS)
    tok.chat_template = VL_CHAT_TEMPLATE
    return tok


def tiny_vl_config(
    kind: str, tok: PreTrainedTokenizerFast, *, hidden_size: int = 32, num_layers: int = 2
) -> PretrainedConfig:
    """The float32 config of a tiny `kind` model over tokenizer `tok` (its vision token ids, eos and pad)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    if kind not in VL_KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {VL_KINDS}")
    heads = 4
    head_dim = hidden_size // heads
    if head_dim % 8:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of 32 (4 heads, mrope sections of 8)")
    half = head_dim // 2  # mrope splits the rotary half-dimension into temporal / height / width sections
    section = [half // 2, half // 4, half - half // 2 - half // 4]
    text: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0},
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    vision: dict[str, Any] = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=hidden_size,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )
    ids = dict(
        image_token_id=tok.convert_tokens_to_ids(IMAGE_PAD),
        video_token_id=tok.convert_tokens_to_ids(VIDEO_PAD),
        vision_start_token_id=tok.convert_tokens_to_ids(VISION_START),
        vision_end_token_id=tok.convert_tokens_to_ids(VISION_END),
    )
    if kind == "qwen2_5_vl":
        vision.update(fullatt_block_indexes=[1], window_size=56)  # block 0 windowed, block 1 full
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    else:
        text.update(head_dim=head_dim)
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    config.dtype = "float32"
    return config


def _write_processor_files(out: Path, kind: str) -> None:
    """The image processor's preprocessor_config.json and the processor's processor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )
    image_processor.save_pretrained(out)
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": _PROCESSOR_CLASS[kind]}, indent=2) + "\n"
    )


def build_tiny_vlm(
    out_dir: str | os.PathLike[str],
    kind: str = "qwen2_5_vl",
    task: str = DEFAULT_TASK,
    seed: int = 0,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    vocab_size: int = 64,
    overwrite: bool = False,
) -> Path:
    """Write a tiny random `kind` VL model, its tokenizer and image processor to `out_dir`; return its path.

    Deterministic for a seed; torch's global RNG is left as it was. Built in `out_dir.tmp` and renamed into place;
    an existing non-empty `out_dir` raises FileExistsError unless `overwrite`.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    tok = build_vl_tokenizer(task, vocab_size)
    config = tiny_vl_config(kind, tok, hidden_size=hidden_size, num_layers=num_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config).float()
    save_model_dir(model, tok, out, extra=lambda tmp: _write_processor_files(tmp, kind))
    return out


__all__ = [
    "ENDOFTEXT",
    "IMAGE_PAD",
    "VISION_TOKENS",
    "VL_CHAT_TEMPLATE",
    "VL_KINDS",
    "build_tiny_vlm",
    "build_vl_tokenizer",
    "tiny_vl_config",
]


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m miles.tools.tiny_vlm --out DIR --kind qwen2_5_vl`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--kind", default="qwen2_5_vl", choices=VL_KINDS)
    p.add_argument("--task", default=DEFAULT_TASK, help="toy task the tokenizer covers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    a = p.parse_args(argv)
    out = build_tiny_vlm(a.out, a.kind, a.task, a.seed, overwrite=a.overwrite)
    print(f"wrote tiny {a.kind} model to {out}")


if __name__ == "__main__":
    main()
