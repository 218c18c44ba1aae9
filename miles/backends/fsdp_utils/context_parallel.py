"""Context parallelism for packed rows: split one pack across CP ranks, attend across ranks, gather results.

Split: the pack row (T tokens) is padded at the end with at most cp_size - 1 tokens so it divides evenly,
and rank r takes the contiguous chunk [r*C, (r+1)*C), C = T_pad / cp_size. We chose contiguous chunks over
a zigzag split because (1) the attention below all-gathers K/V and every rank computes its queries against
the keys it needs, so the causal work imbalance that zigzag fixes for ring attention is small here and
shrinks further for packs of many sequences; (2) next-token targets stay trivial: the last token of rank
r's chunk predicts the first token of rank r+1's chunk, and results concatenate back in rank order;
(3) it is the layout flash-attn's varlen kernels (and ring-flash-attn's all-gather variant) expect.
The padding forms its own segment, so it attends only to itself and never to real tokens.

Attention: each rank all-gathers K and V (one collective for both) with an autograd-aware all-gather whose
backward sums the gradients across ranks (reduce-scatter), then applies a block-diagonal causal mask in
global positions: a query at global position p of sequence s sees keys q <= p of sequence s, on any rank.

Gradients: results (log-probs, entropy) are gathered with the same all-gather, so every CP rank computes the
same loss; the backward all-reduces, so each rank's parameter gradient is cp_size times its share and the
*mean* over the CP group equals the CP=1 gradient. FSDP2's default gradient averaging over a mesh that
includes the CP dimension therefore gives the CP=1 (per DP rank: DP-mean) gradient with no rescaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["CPContext", "CPShard", "all_gather_autograd", "cp_attention", "shard_for_cp"]


@dataclass(frozen=True)
class CPContext:
    """One rank's view of its context-parallel group."""

    group: Any  # torch.distributed ProcessGroup of the CP ranks (None: the default world group)
    rank: int  # rank within the CP group
    size: int  # CP group size

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"CPContext needs size >= 1 and 0 <= rank < size, got rank={self.rank} size={self.size}"
            )


@dataclass
class CPShard:
    """A pack padded for CP, and which chunk of it this rank computes. Passed to attention as `miles_cp`."""

    cp: CPContext
    tokens: torch.Tensor  # [T_pad] long, the whole padded row (every rank holds it: targets cross chunks)
    position_ids: torch.Tensor  # [T_pad] long
    cu_seqlens: torch.Tensor  # [m+1] int32 over the padded row; the padding (if any) is the last segment
    num_real_tokens: int  # T, before padding
    chunk: int  # C = T_pad / cp_size, tokens per rank

    @property
    def start(self) -> int:
        return self.cp.rank * self.chunk

    @property
    def local_tokens(self) -> torch.Tensor:  # [C]
        return self.tokens[self.start : self.start + self.chunk]

    @property
    def local_position_ids(self) -> torch.Tensor:  # [C]
        return self.position_ids[self.start : self.start + self.chunk]

    def local_next_tokens(self) -> torch.Tensor:
        """[C] the token each local position predicts (the next one in the row; 0 after the row's end).

        The last local token's target is the first token of the next rank's chunk. Positions whose next
        token belongs to another sequence get that token too; callers keep only in-sequence positions.
        """
        nxt = torch.cat([self.tokens[1:], self.tokens.new_zeros(1)])
        return nxt[self.start : self.start + self.chunk]


def shard_for_cp(
    tokens: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, cp: CPContext, pad_id: int = 0
) -> CPShard:
    """Pad a pack row by at most cp.size - 1 tokens (id `pad_id`, positions 0..pad-1) and pick this rank's chunk."""
    t = int(tokens.numel())
    if int(cu_seqlens[-1]) != t or position_ids.numel() != t:
        raise ValueError(
            f"pack row of {t} tokens disagrees with cu_seqlens[-1]={int(cu_seqlens[-1])} or positions"
        )
    pad = (-t) % cp.size
    if pad:
        tokens = torch.cat([tokens, tokens.new_full((pad,), pad_id)])
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)])
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([t + pad])])
    return CPShard(
        cp=cp,
        tokens=tokens,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens.to(torch.int32),
        num_real_tokens=t,
        chunk=(t + pad) // cp.size,
    )


class _AllGather(torch.autograd.Function):
    """Concatenate equal-shaped tensors from all group ranks along `dim`; backward sums and scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cp, dim = ctx.cp, ctx.dim
        chunks = [c.contiguous() for c in grad.chunk(cp.size, dim=dim)]
        if dist.get_backend(cp.group) == "nccl":
            out = torch.empty_like(chunks[cp.rank])
            dist.reduce_scatter(out, chunks, group=cp.group)
            return out, None, None
        total = grad.contiguous().clone()  # gloo has no reduce_scatter: all-reduce, keep our chunk
        dist.all_reduce(total, group=cp.group)
        return total.chunk(cp.size, dim=dim)[cp.rank].contiguous(), None, None


def all_gather_autograd(x: torch.Tensor, cp: CPContext, dim: int = 0) -> torch.Tensor:
    """All-gather `x` (same shape on every rank) along `dim`, in rank order; gradients are summed over ranks."""
    if cp.size == 1:
        return x
    return _AllGather.apply(x, cp, dim)


def _segment_ids(positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(positions, cu_seqlens[1:].to(positions.device, torch.long), right=True)


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: CPShard,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys of the same sequence.

    query [1, H, C, D], key/value [1, Hkv, C, D] (this rank's chunk) -> [1, C, H, D]. Differentiable; the
    K/V gradient flows back to the rank that produced each key.
    """
    if query.shape[0] != 1:
        raise ValueError(f"context-parallel attention expects one packed row, got batch {query.shape[0]}")
    hkv = key.shape[1]
    kv = all_gather_autograd(torch.cat([key, value], dim=1), shard.cp, dim=2)  # [1, 2*Hkv, T_pad, D]
    start, c = shard.start, shard.chunk
    device = query.device
    cu = shard.cu_seqlens.to(device=device, dtype=torch.long)
    q_pos = torch.arange(start, start + c, device=device)
    q_seg = _segment_ids(q_pos, cu)
    # Keys needed: from the start of the first local query's sequence up to the last local query.
    k_lo = int(cu[int(q_seg[0])])
    k_pos = torch.arange(k_lo, start + c, device=device)
    k_seg = _segment_ids(k_pos, cu)
    mask = (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    k_full, v_full = kv[:, :hkv, k_lo : start + c], kv[:, hkv:, k_lo : start + c]
    out = F.scaled_dot_product_attention(
        query,
        k_full,
        v_full,
        attn_mask=mask[None, None],
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != hkv,
    )
    return out.transpose(1, 2).contiguous()
