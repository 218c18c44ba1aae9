"""Refit names of vision-language models as SGLang 0.5.23's Qwen2.5-VL / Qwen3-VL loaders take them (issue 27).

transformers 5 names a Qwen-VL model's tensors `model.language_model.*` (decoder), `model.visual.*` (vision tower)
and `lm_head.*`. SGLang's `Qwen2_5_VLForConditionalGeneration.load_weights`, which `update_weights_from_tensor` /
`_from_distributed` call with the names as sent, looks names up in its own parameters, `model.*`, `visual.*`,
`lm_head.*`, and skips a name it does not have without a word; it renames only `attn.qkv.` to `attn.qkv_proj.`
(vision) and the stacked q/k/v, gate/up shards. Its Qwen3-VL loader also strips `model.language_model.` and
`model.visual.`. So a refit sends the checkpoint-style names both accept: `model.language_model.X` -> `model.X`,
`model.visual.X` -> `visual.X` (`tests/integration/test_sglang_vl_names.py` checks them against the installed
SGLang's own parameters). The embedded engine answers to both spellings (`miles.engines.local.weights`).
Text-only models have neither prefix; their names pass unchanged.
"""

from __future__ import annotations

_TO_ENGINE = (("model.language_model.", "model."), ("model.visual.", "visual."))


def engine_name(name: str) -> str:
    """The name SGLang's Qwen-VL loaders take for the HF (transformers 5) parameter `name`."""
    for hf_prefix, sglang_prefix in _TO_ENGINE:
        if name.startswith(hf_prefix):
            return sglang_prefix + name[len(hf_prefix) :]
    return name
