"""Context parallelism for packed rows: split one pack across CP ranks, attend across ranks, gather results.

Split: the pack row (T tokens) is padded at the end with at most cp_size - 1 tokens so it divides evenly,
and rank r takes the contiguous chunk [r*C, (r+1)*C), C = T_pad / cp_size. We chose contiguous chunks over
a zigzag split because (1) every rank gathers the keys its queries need, so the causal work imbalance that
zigzag fixes for ring attention is small here and shrinks further for packs of many sequences; (2) next-token
targets stay trivial: the last token of rank r's chunk predicts the first token of rank r+1's chunk, and
results concatenate back in rank order; (3) it is the layout ring-flash-attn's llama3 varlen kernel expects.
The padding forms its own segment, so it attends only to itself and never to real tokens.

Attention, two kernels (`set_cp_kernel`):
- "ring" (CUDA with FlashAttention-2, i.e. --attn-implementation flash_attention_2 or miles_varlen):
  ring-flash-attn's `llama3_flash_attn_varlen_func`: all-gathers K/V (KV heads in groups of
  `RING_HEADS_K_STRIDE`, overlapping the next group's gather with this group's kernel), runs flash-attn's varlen
  forward on the keys the local queries need (bottom-right causal alignment) and reduce-scatters dK/dV in
  backward. Its module is loaded without running the package's `__init__`, which imports its HF adapter (broken
  under transformers 5); the adapter is never used.
- "allgather" (CPU, and CUDA with SDPA): the reference in plain torch. K and V are all-gathered (one collective)
  with an autograd-aware all-gather whose backward sums the gradients across ranks (reduce-scatter), then a
  block-diagonal causal mask in global positions: a query at global position p of sequence s sees keys q <= p of
  sequence s, on any rank.

Gradients: results (log-probs, entropy) are gathered with the same all-gather, so every CP rank computes the
same loss; the backward all-reduces, so each rank's parameter gradient is cp_size times its share and the
*mean* over the CP group equals the CP=1 gradient. FSDP2's default gradient averaging over a mesh that
includes the CP dimension therefore gives the CP=1 (per DP rank: DP-mean) gradient with no rescaling.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.backends.fsdp_utils.attention import flash_attn_installed, use_flash_kernel, varlen_backend

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

__all__ = [
    "CPContext",
    "CPShard",
    "all_gather_autograd",
    "cp_attention",
    "cp_gather_rows",
    "cp_local_rows",
    "cp_real_rows",
    "import_ring_kernels",
    "set_cp_kernel",
    "shard_for_cp",
]

_CP_KERNELS = ("auto", "ring", "allgather")
_cp_kernel = "auto"
# KV heads all-gathered per ring-flash-attn step; None: all of them in one step (one gather of K, one of V)
RING_HEADS_K_STRIDE: int | None = None
RING_INSTALL = "ring-flash-attn: pip install 'miles[gpu]' (or pip install --no-deps ring-flash-attn)"


def set_cp_kernel(name: str) -> None:
    """Context-parallel attention kernel: "auto" (ring-flash-attn where the varlen backend runs
    FlashAttention-2, the plain-torch all-gather otherwise), "ring", or "allgather"."""
    global _cp_kernel
    if name not in _CP_KERNELS:
        raise ValueError(f"context-parallel attention kernel {name!r} is not one of {_CP_KERNELS}")
    _cp_kernel = name


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


def cp_real_rows(num_tokens: int, cp: CPContext) -> tuple[int, int, int]:
    """(start, chunk, real) of this rank's chunk of a pack row of `num_tokens` tokens split as `shard_for_cp` splits
    it: rows [start, start + chunk) of the padded row, of which the first `real` are pack tokens (the rest padding)."""
    chunk = (num_tokens + (-num_tokens) % cp.size) // cp.size
    start = cp.rank * chunk
    return start, chunk, max(0, min(chunk, num_tokens - start))


def cp_local_rows(x: torch.Tensor, cp: CPContext, fill: int | float) -> torch.Tensor:
    """This rank's rows of per-token `x` ([T, ...], one row per pack token), split exactly as `shard_for_cp`
    splits the tokens; padding rows hold `fill`."""
    start, chunk, real = cp_real_rows(x.shape[0], cp)
    out = x.new_full((chunk, *x.shape[1:]), fill)
    out[:real] = x[start : start + real]
    return out


def cp_gather_rows(x: torch.Tensor, cp: CPContext, num_tokens: int) -> torch.Tensor:
    """The inverse of `cp_local_rows` (no gradient): every rank's [chunk, ...] rows in rank order, without the
    padding: [num_tokens, ...] on every rank of the group. Collective over the CP group."""
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    return torch.cat(parts)[:num_tokens]


def _segment_ids(positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(positions, cu_seqlens[1:].to(positions.device, torch.long), right=True)


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


# the private package name under which ring_flash_attn's directory is loaded, without its __init__
_RING_PACKAGE = "_miles_ring_flash_attn"


def import_ring_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """ring-flash-attn's (llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func).

    The package's `__init__` imports every variant and its HF adapter, which fails under transformers 5; the
    kernel module is imported on its own from the installed package directory, under a private package name
    (so a plain `import ring_flash_attn` elsewhere is unaffected). It imports flash-attn's
    `_flash_attn_varlen_forward` / `_flash_attn_varlen_backward` (FlashAttention-2). Raises ImportError naming the
    missing package.
    """
    name = f"{_RING_PACKAGE}.llama3_flash_attn_varlen"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                f"context-parallel attention on CUDA runs ring-flash-attn; install {RING_INSTALL}"
            )
        if _RING_PACKAGE not in sys.modules:
            package = types.ModuleType(_RING_PACKAGE)
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules[_RING_PACKAGE] = package
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ImportError(
                f"ring-flash-attn's llama3 varlen kernel does not import ({e}); it runs FlashAttention-2: "
                "pip install 'miles[gpu]'"
            ) from e
    return module.llama3_flash_attn_prepare_cu_seqlens, module.llama3_flash_attn_varlen_func


def _use_ring(query: torch.Tensor) -> bool:
    if _cp_kernel != "auto":
        return _cp_kernel == "ring"
    if not use_flash_kernel(query):
        return False
    if varlen_backend() == "flash3":
        raise ValueError(
            "FlashAttention-3 has no context-parallel kernel (ring-flash-attn runs FlashAttention-2's); "
            "use --attn-implementation flash_attention_2 with --context-parallel-size > 1"
        )
    # miles_varlen without flash-attn runs torch's own varlen kernel, which ring-flash-attn cannot call
    return varlen_backend() != "auto" or flash_attn_installed()


def _attend_ring(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: CPShard,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """query [1, H, C, D], key/value [1, Hkv, C, D] (this rank's chunk) -> [1, H, C, D] through ring-flash-attn's
    llama3 varlen kernel over the CP group (it gathers K/V itself; its backward reduce-scatters dK/dV)."""
    prepare, llama3_varlen = import_ring_kernels()
    cu = shard.cu_seqlens.to(device=query.device, dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, local_k_slice = prepare(cu, True, shard.cp.rank, shard.cp.size)
    hkv = key.shape[1]
    out = llama3_varlen(
        query[0].transpose(0, 1),  # [C, H, D]
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_q,
        cu_k,
        max_q,
        max_k,
        heads_k_stride=RING_HEADS_K_STRIDE or hkv,
        local_k_slice=local_k_slice,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
        group=shard.cp.group,
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

    query [1, H, C, D], key/value [1, Hkv, C, D] (this rank's chunk) -> [1, C, H, D]. The kernel is
    ring-flash-attn's llama3 varlen with FlashAttention-2 (see `set_cp_kernel`), else the plain-torch all-gather
    with SDPA and a block-diagonal causal mask in global positions. Differentiable; the K/V gradient flows back
    to the rank that produced each key.
    """
    if query.shape[0] != 1:
        raise ValueError(f"context-parallel attention expects one packed row, got batch {query.shape[0]}")
    if _use_ring(query):
        out = _attend_ring(query, key, value, shard, scaling, dropout)
    else:
        kv = all_gather_autograd(torch.cat([key, value], dim=1), shard.cp, dim=2)  # [1, 2*Hkv, T_pad, D]
        out = _attend_sdpa(query, kv, shard, scaling, dropout)
    return out.transpose(1, 2).contiguous()
