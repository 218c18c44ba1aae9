"""Validation of hybrid (linear-attention) models such as Qwen3-Next (issue 28, item 5, built in part).

Built: FSDP2 training with packing (each linear-attention layer runs once per packed sequence, see
backends/fsdp_utils/linear_attention.py), MoE losses and routing replay on its routers, and serving by the embedded
engine's full-forward runner. Refused here before Ray starts, when the checkpoint's config.json (a local directory)
lists `linear_attention` layers: context parallelism (it would cut a sequence's recurrent state across ranks),
tensor parallelism and expert parallelism (their plans do not cover the linear-attention layers).
"""

from __future__ import annotations

import json
import os
from contextlib import suppress

from miles.config.schema import FIELDS
from miles.config.values import Skip, Values

_WHY = {
    "context_parallel_size": "context parallelism would split a sequence's linear-attention recurrence across ranks",
    "tensor_model_parallel_size": "the tensor-parallel plan does not cover linear-attention layers",
    "expert_model_parallel_size": "expert parallelism is not built for hybrid models",
}


def has_linear_attention_layers(path: object) -> bool:
    """Whether the HF directory `path`'s config.json lists `linear_attention` layers (False when unreadable)."""
    if not isinstance(path, str):
        return False
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False  # a missing or broken config is reported by the checkpoint checks
    layer_types = config.get("layer_types") if isinstance(config, dict) else None
    return isinstance(layer_types, list) and "linear_attention" in layer_types


def hybrid_models(v: Values) -> None:
    """Refuse CP, TP and EP (where the flag exists) > 1 with a linear-attention checkpoint."""
    sizes = {}
    for name in _WHY:
        if name in FIELDS:
            with suppress(Skip):  # a size another rule already refused is not refused twice
                sizes[name] = v[name]
    with suppress(Skip):
        if all(size == 1 for size in sizes.values()) or not has_linear_attention_layers(v["hf_checkpoint"]):
            return
    for name, size in sizes.items():
        if size != 1:
            v.fail(
                name,
                "is not supported with linear-attention (hybrid) models such as Qwen3-Next yet (issue 28): "
                f"{_WHY[name]}; allowed: 1",
            )
