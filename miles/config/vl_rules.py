"""Validation of vision-language runs (issue 27, built in part).

What exists: tiny Qwen2.5-VL / Qwen3-VL models (miles.tools.tiny_vlm), the image data path (miles.rollout.multimodal
and the data source: `--multimodal-keys` fills `Sample.multimodal_data` and expanded prompt ids), the FSDP2 trainer
(the VL model built and sharded, `--freeze-vision-tower`, packed VL log-prob / train / reference forwards:
miles.backends.fsdp_utils.vl_train), HF export and the toy image tasks. The whole loop runs and learns on CPU with the
embedded engine (tests/e2e/test_tiny_vlm_learns.py). Refused here, before Ray starts: context parallelism (its own
reason), LoRA with a VL model (not proven end to end), `--freeze-vision-tower` without a VL checkpoint. SGLang
engines are allowed (`auto` picks them on GPU machines): their request shape and refit names are checked against
SGLang's source, but no run with them was made here (docs/vlm.md). Multi-turn tool answers may carry images (miles.rollout.multi_turn).
"""

from __future__ import annotations

import json
import os

from miles.config.values import Values

SUPPORTED_MODALITIES = ("image",)
_NOT_PROVEN = (
    "is not proven end to end yet (issue 27: the VL loop is tested with the embedded engine and full "
    "fine-tuning); see docs/vlm.md"
)


def parse_multimodal_keys(value: str | dict[str, str] | None) -> dict[str, str] | None:
    """The `--multimodal-keys` mapping (modality -> sample field), checked; None stays None.

    ValueError naming the flag for non-JSON, a non-object, a modality other than "image" or a non-string field.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f'--multimodal-keys={value!r} is not JSON ({e.msg}); e.g. \'{{"image": "images"}}\''
            ) from None
    if not isinstance(value, dict) or not value:
        raise ValueError(
            f'--multimodal-keys must be a non-empty JSON object like {{"image": "images"}}, got {value!r}'
        )
    for modality, key in value.items():
        if modality not in SUPPORTED_MODALITIES:
            raise ValueError(
                f"--multimodal-keys: modality {modality!r} is not supported (allowed: {SUPPORTED_MODALITIES}; "
                "video and audio are not built, issue 27)"
            )
        if not isinstance(key, str) or not key:
            raise ValueError(
                f"--multimodal-keys: the field for {modality!r} must be a non-empty string, got {key!r}"
            )
    return dict(value)


def parse_multimodal_keys_flag(v: Values) -> dict[str, str] | None:
    """The checked `--multimodal-keys` mapping (None when unset or empty); records a violation when malformed."""
    raw = v["multimodal_keys"]
    if not raw:
        return None
    try:
        return parse_multimodal_keys(raw)
    except ValueError as e:
        v.fail("multimodal_keys", str(e))
        return None


def is_vl_checkpoint(path: object) -> bool:
    """Whether the HF directory `path` holds a vision-language model (its config.json has a `vision_config`)."""
    if not isinstance(path, str):
        return False
    config = os.path.join(path, "config.json")
    try:
        with open(config) as f:
            return isinstance(json.load(f).get("vision_config"), dict)
    except (OSError, ValueError, AttributeError):
        return False  # a missing or broken config is reported by the checkpoint checks


def vision_language(v: Values) -> None:
    """Refuse what issue 27 has not proven for VL runs; context parallelism with VL is refused with its own reason."""
    keys = parse_multimodal_keys_flag(v)
    if "multimodal_keys" in v.bad:
        return
    vl_ckpt = is_vl_checkpoint(v["hf_checkpoint"])
    # a checkpoint without a config.json (not downloaded yet) is named by the pre-flight checks, not here
    unknown = not (
        isinstance(v["hf_checkpoint"], str)
        and os.path.isfile(os.path.join(v["hf_checkpoint"], "config.json"))
    )
    if keys is None and not vl_ckpt and not v["freeze_vision_tower"]:
        return
    if v["context_parallel_size"] > 1:
        v.fail(
            "context_parallel_size",
            "context parallelism is not supported for vision-language models (issue 27): the image features and "
            "3-D rotary position ids of a sequence would be split across ranks; use --context-parallel-size 1",
        )
    if keys is not None and not vl_ckpt and not unknown:
        v.fail(
            "multimodal_keys",
            "needs a vision-language --hf-checkpoint (config.json with vision_config), issue 27",
        )
    if v["freeze_vision_tower"] and not vl_ckpt and not unknown:
        v.fail(
            "freeze_vision_tower",
            "needs a vision-language checkpoint (config.json with vision_config), issue 27",
        )
    if v["lora_rank"]:
        v.fail("lora_rank", f"LoRA on a vision-language model {_NOT_PROVEN}")
