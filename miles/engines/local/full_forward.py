"""The embedded engine's fallback model runner (`NoCacheRunner`): a full forward of each row's whole sequence per
step, no KV cache. It serves architectures `model_runner.PoolRunner` does not know (`make_runner` picks it),
and is the base of the VL runner and of routed-expert capture for those (`routing_capture.RecordingRunner`).

Qwen3-Next stays here (Qwen3-MoE moved to `PoolRunner`): its gated-delta-net layers carry a conv window and a
recurrent state per sequence instead of per-position keys/values, so a cache for them is a per-slot state pool
(updated in place at each step, moved with a slot, dropped at a retract) that `KVPool` does not have, plus a
per-row recurrent step of transformers' torch fallback on packed tokens. The issue asks for serving, and a full
forward per step is exact and enough for the tiny runs (it costs O(length^2) per sequence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from miles.engines.local.scheduler import Batch


class NoCacheRunner:
    """Fallback for architectures `PoolRunner` does not know: a full forward of each row's sequence."""

    uses_kv_cache = False

    def active_decode_kernel(self) -> None:  # the full forward has no decode attention of its own
        return None

    def __init__(self, model: nn.Module):
        self.model = model
        self.history: dict[int, list[int]] = {}  # slot -> tokens fed so far

    def release_kv(self) -> None:
        self.history.clear()

    def resume_kv(self) -> None:
        pass

    def kv_allocated_bytes(self) -> int:
        return 0

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Extend each row's token history; a full forward per sampling row. Returns fp32 logits [rows, V]."""
        for src, dst, length in batch.moves:
            self.history[dst] = self.history[src][:length]
        out = []
        for r in batch.rows:
            seq = self.history[r.slot] = self.history.get(r.slot, [])[: r.start] + list(r.token_ids)
            if r.sample:
                ids = torch.tensor([seq], device=self.model.device)
                out.append(self.model(input_ids=ids, use_cache=False).logits[0, -1].float())
        if not out:  # only prefill chunks were fed (a long prompt, nothing decoding): no row samples
            return (
                self.model.get_output_embeddings().weight.new_zeros(0, self.model.config.vocab_size).float()
            )
        return torch.stack(out)
