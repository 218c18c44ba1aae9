"""SGLang's routed-experts layout (`return_routed_experts`), numpy only (the rollout side reads it too).

`meta_info["routed_experts"]` is the base64 of the raw bytes of an int32 array [seqlen - 1, num_layers, top_k]:
row t holds the experts position t was routed to in every layer (positions 0..seqlen-2; the last sampled token is
never forwarded). A `Sample` keeps it compactly as [seqlen - 1, num_layers * top_k] uint8 (int16 past 255 experts).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

# transformers' router modules whose output is (logits [N, E], gate weights [N, K], expert ids [N, K]); the trainer
# (backends/fsdp_utils/moe.py) and the embedded engine (engines/local/routing_capture.py) hook these
ROUTER_CLASS_NAMES = ("Qwen3MoeTopKRouter", "Qwen3NextTopKRouter")


def moe_routers(model: Any) -> list[Any]:
    """The router of every MoE layer of `model` (a torch module), in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASS_NAMES]


def encode_routed_experts(experts: np.ndarray) -> str:
    """SGLang's `meta_info["routed_experts"]`: base64 of the int32 [seqlen - 1, L, K] array's bytes."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(text: str, num_rows: int) -> np.ndarray:
    """The int32 array SGLang encoded, as a compact [num_rows, L*K] array (uint8 when every id fits, else
    int16); ValueError when its length is not a multiple of `num_rows`."""
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if num_rows <= 0 or flat.size % num_rows:
        raise ValueError(f"routed_experts holds {flat.size} ids, not a multiple of {num_rows} token rows")
    compact = np.uint8 if flat.size == 0 or (flat.min() >= 0 and flat.max() < 256) else np.int16
    return flat.reshape(num_rows, -1).astype(compact)
