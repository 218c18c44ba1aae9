"""Validation of expert parallelism (`--expert-model-parallel-size`, issue 28, built for Qwen3-MoE).

Built and tested: Qwen3-MoE decoders (transformers' stacked experts) with each MoE layer's experts split over groups
of E consecutive training ranks, FSDP2 over the ranks holding the same experts (see
`miles.backends.fsdp_utils.expert_parallel`), with routing replay and the router losses, with or without context
parallelism (the EP groups are consecutive ranks of the row-major (dp, cp) layout); the refit gathers full
tensors. Refused here before Ray starts: an E that does not divide the training ranks or the model's experts, a
dense checkpoint, and what is not built or tested with EP: tensor parallelism, LoRA, the PPO critic,
vision-language models. The checkpoint's config.json is read when it is a local directory (the trainer checks the
built model again).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import suppress

from miles.config.values import Skip, Values

_FLAG = "--expert-model-parallel-size"
_WITH = f"is not supported with {_FLAG} > 1 yet (issue 28); allowed: "
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_parallel(v: Values) -> None:
    with suppress(Skip):
        ep = v["expert_model_parallel_size"]
        if ep == 1:
            return
        world = v["actor_num_nodes"] * v["actor_num_gpus_per_node"]
        if world % ep:
            v.fail(
                "expert_model_parallel_size",
                f"must divide the actor world size {world} (nodes * gpus per node)",
            )
        if v["tensor_model_parallel_size"] > 1:
            v.fail("tensor_model_parallel_size", _WITH + "1")
        if v["lora_rank"] > 0:
            v.fail("lora_rank", _WITH + "0")
        if v["advantage_estimator"] == "ppo":  # the critic's value head is not built or tested under EP
            v.fail("advantage_estimator", _WITH + "an estimator without a critic (grpo, ...)")
        if v["multimodal_keys"] or v["freeze_vision_tower"]:
            v.fail("multimodal_keys" if v["multimodal_keys"] else "freeze_vision_tower", _WITH + "unset")
        for problem in checkpoint_ep_problems(v["hf_checkpoint"], ep):
            v.fail("expert_model_parallel_size", f"{problem} (--hf-checkpoint {v['hf_checkpoint']})")


def ep_problems(config: Mapping[str, object], ep_size: int) -> list[str]:
    """What keeps a HF decoder config (its config.json as a dict) from `ep_size`-way expert parallelism; [] if
    nothing."""
    if ep_size == 1:
        return []
    experts = next((config[k] for k in EXPERT_KEYS if config.get(k)), None)
    if not isinstance(experts, int):
        return ["the model has no MoE experts (dense models train with --expert-model-parallel-size 1)"]
    if config.get("vision_config") is not None:
        return ["vision-language models are not supported with expert parallelism yet (issue 28)"]
    if experts % ep_size:
        return [f"must divide the model's number of experts ({experts})"]
    return []


def checkpoint_ep_problems(path: object, ep_size: int) -> list[str]:
    """`ep_problems` of the HF directory `path`'s config.json; [] when there is none to read (a hub name)."""
    if ep_size == 1 or not isinstance(path, str):
        return []
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return []
    with open(file) as f:
        return ep_problems(json.load(f), ep_size)
