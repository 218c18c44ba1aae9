"""Context parallelism for packed rows: split one pack across CP ranks, attend across ranks, gather results.

Split: the pack row (T tokens) is padded at the end with at most cp_size - 1 tokens so it divides evenly,
and rank r takes the contiguous chunk [r*C, (r+1)*C), C = T_pad / cp_size. We chose contiguous chunks over
a zigzag split because (1) the attention below all-gathers K/V and every rank computes its queries against
the keys it needs, so the causal work imbalance that zigzag fixes for ring attention is small here and
shrinks further for packs of many sequences; (2) next-token targets stay trivial: the last token of rank
r's chunk predicts the first token of rank r+1's chunk, and results concatenate back in rank order;
(3) it is the layout flash-attn's varlen kernels (and ring-flash-attn's all-gather variant) expect: on
CUDA with flash-attn importable the local queries run `flash_attn_varlen_func` against the gathered keys of
their sequences (bottom-right causal alignment, `cp_key_layout`); ring-flash-attn itself is not imported.
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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.backends.fsdp_utils.attention import _import_flash_varlen, use_flash_kernel

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

__all__ = ["CPContext", "CPShard", "all_gather_autograd", "cp_attention", "cp_key_layout", "shard_for_cp"]


@dataclass(frozen=True)
class CPContext:
    """One rank's view of its context-parallel group."""

    group: dist.ProcessGroup | None  # the CP ranks' group (None: the default world group)
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
    def forward(ctx: FunctionCtx, x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
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


def cp_key_layout(shard: CPShard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Which global keys this rank's queries need, per sequence, in flash-attn varlen form.

    For each sequence [a, b) overlapping the local chunk [s, e): queries [max(a, s), min(b, e)) and keys
    [a, min(b, e)). With bottom-right aligned causal masking (flash-attn >= 2.1), query i of a sequence sees
    keys 0 .. (lk - lq) + i, i.e. exactly the keys at or before its global position.

    Returns (key_index [K] long into the padded row, cu_q [m+1] int32, cu_k [m+1] int32, max_q, max_k).
    """
    s, e = shard.start, shard.start + shard.chunk
    bounds = shard.cu_seqlens.tolist()
    key_ranges, lq, lk = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qa, qb = max(a, s), min(b, e)
        if qb > qa:
            key_ranges.append(torch.arange(a, qb))
            lq.append(qb - qa)
            lk.append(qb - a)
    cu_q = torch.tensor([0, *lq]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lk]).cumsum(0).to(torch.int32)
    return torch.cat(key_ranges), cu_q, cu_k, max(lq), max(lk)


def _attend_sdpa(
    query: torch.Tensor, kv: torch.Tensor, shard: CPShard, scaling: float | None, dropout: float
) -> torch.Tensor:
    """query [1, H, C, D], kv [1, 2*Hkv, T_pad, D] (gathered) -> [1, H, C, D] with a global-position mask."""
    hkv = kv.shape[1] // 2
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
    return F.scaled_dot_product_attention(
        query,
        kv[:, :hkv, k_lo : start + c],
        kv[:, hkv:, k_lo : start + c],
        attn_mask=mask[None, None],
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != hkv,
    )


def _attend_flash(
    query: torch.Tensor, kv: torch.Tensor, shard: CPShard, scaling: float | None, dropout: float
) -> torch.Tensor:
    """As `_attend_sdpa`, with flash-attn's varlen kernel on the gathered keys (CUDA)."""
    flash_varlen = _import_flash_varlen()
    hkv = kv.shape[1] // 2
    key_index, cu_q, cu_k, max_q, max_k = cp_key_layout(shard)
    device = query.device
    kv_sel = kv[0].index_select(1, key_index.to(device)).transpose(0, 1)  # [K, 2*Hkv, D]
    out = flash_varlen(
        query[0].transpose(0, 1),
        kv_sel[:, :hkv],
        kv_sel[:, hkv:],
        cu_q.to(device),
        cu_k.to(device),
        max_q,
        max_k,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
    )  # [C, H, D]
    return out.transpose(0, 1)[None]


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: CPShard,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys of the same sequence.

    query [1, H, C, D], key/value [1, Hkv, C, D] (this rank's chunk) -> [1, C, H, D]. K and V are
    all-gathered (one collective); the kernel is flash-attn varlen on CUDA when selected (see
    attention.set_varlen_backend), else SDPA with a block-diagonal causal mask in global positions.
    Differentiable; the K/V gradient flows back to the rank that produced each key.
    """
    if query.shape[0] != 1:
        raise ValueError(f"context-parallel attention expects one packed row, got batch {query.shape[0]}")
    kv = all_gather_autograd(torch.cat([key, value], dim=1), shard.cp, dim=2)  # [1, 2*Hkv, T_pad, D]
    attend = _attend_flash if use_flash_kernel(query) else _attend_sdpa
    return attend(query, kv, shard, scaling, dropout).transpose(1, 2).contiguous()
