"""Validation of tensor parallelism (`--tensor-model-parallel-size`, issue 28, built for dense decoders and
Qwen3-MoE).

Built and tested: dense Qwen3 / Llama-style decoders and Qwen3-MoE (attention split, experts whole on every TP rank,
with routing replay and the router losses) on a DP x TP mesh (FSDP2 over the data-parallel ranks), the refit of
full tensors and DCP checkpoints that resume across a changed TP size. Not built or not tested with TP, so refused
here before Ray starts: context parallelism, LoRA, the PPO critic, MoE models other than Qwen3-MoE (Qwen3-Next's
linear attention is refused in hybrid_rules.py, expert parallelism in ep_rules.py), vision-language models. The checkpoint's config.json is read when it is a local directory: the TP size must divide its attention
heads, KV heads and MLP width.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import suppress

from miles.config.values import Skip, Values

_FLAG = "--tensor-model-parallel-size"
TP_MOE_MODEL_TYPES = ("qwen3_moe",)  # experts kept whole on every TP rank (fsdp_utils/tensor_parallel.py)
_WITH = "is not supported with --tensor-model-parallel-size > 1 yet (issue 28); allowed: "


def tensor_parallel(v: Values) -> None:
    with suppress(Skip):
        tp = v["tensor_model_parallel_size"]
        if tp == 1:
            return
        if v["context_parallel_size"] > 1:
            v.fail("context_parallel_size", _WITH + "1")
        if v["lora_rank"] > 0:
            v.fail("lora_rank", _WITH + "0")
        if v["advantage_estimator"] == "ppo":  # the critic's value head is not built or tested under TP
            v.fail("advantage_estimator", _WITH + "an estimator without a critic (grpo, ...)")
        if v["multimodal_keys"] or v["freeze_vision_tower"]:
            v.fail("multimodal_keys" if v["multimodal_keys"] else "freeze_vision_tower", _WITH + "unset")
        for problem in checkpoint_tp_problems(v["hf_checkpoint"], tp):
            v.fail("tensor_model_parallel_size", f"{problem} (--hf-checkpoint {v['hf_checkpoint']})")


def tp_problems(config: Mapping[str, object], tp_size: int) -> list[str]:
    """What keeps a HF decoder config (its config.json as a dict) from `tp_size`-way tensor parallelism; [] if
    nothing. Dense decoders and Qwen3-MoE (`TP_MOE_MODEL_TYPES`); other MoE and vision-language models are not
    built (issue 28)."""
    if tp_size == 1:
        return []
    problems = []
    if config.get("vision_config") is not None:
        problems.append("vision-language models are not supported with tensor parallelism yet (issue 28)")
    moe = any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if moe and config.get("model_type") not in TP_MOE_MODEL_TYPES:
        problems.append(
            f"MoE models of type {config.get('model_type')!r} are not supported with tensor parallelism yet "
            f"(issue 28); supported MoE types: {TP_MOE_MODEL_TYPES}"
        )
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = config.get(key)
        if isinstance(value, int) and value % tp_size:
            problems.append(f"must divide the model's {key}={value}")
    return problems


def checkpoint_tp_problems(path: object, tp_size: int) -> list[str]:
    """`tp_problems` of the HF directory `path`'s config.json; [] when there is none to read (a hub name, a
    directory made later): the trainer checks the built model again (`apply_tensor_parallel`)."""
    if tp_size == 1 or not isinstance(path, str):
        return []
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return []
    with open(file) as f:
        return tp_problems(json.load(f), tp_size)
