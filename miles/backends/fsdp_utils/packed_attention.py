"""Variable-length (packed) attention for HF models, registered as the attention implementation "miles_varlen".

A pack is one row of several sequences; every token attends causally to the earlier tokens of its own
sequence only. Boundaries come from `cu_seq_lens_q` (HF's flash-attention kwarg name, passed to the model
forward) or, when absent, from `position_ids` restarting at 0; never from token values.

Which kernel runs is chosen in attention.py (`select_attention_kernel`, `use_flash_kernel`): a flash varlen
kernel over the whole row, or on CPU (and CUDA with backend "sdpa") SDPA over right-padded batches: sequences of
similar length are gathered into one batch each and each batch is one `scaled_dot_product_attention(is_causal=True)`
call (no Python loop per sequence; the padded work stays within `PAD_WORK_LIMIT` x sum(L_i^2)); each sequence
computes what an unpacked forward would, up to summation order. Under context parallelism (a `miles_cp` kwarg)
context_parallel.py's `cp_attention` runs.

Because "miles_varlen" is not a mask-interface name, HF builds no 4D mask for it (`attention_mask` is None),
which is what a packed row needs. Select it with `enable_varlen_attention(model)`; `forward_packed` does so.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from miles.backends.fsdp_utils.attention import use_flash_kernel, varlen_kernel
from miles.backends.fsdp_utils.linear_attention import segment_linear_attention

if TYPE_CHECKING:
    from miles.backends.fsdp_utils.context_parallel import CPShard

__all__ = [
    "PAD_WORK_LIMIT",
    "VARLEN_ATTENTION",
    "PaddedLayout",
    "cu_seqlens_from_position_ids",
    "enable_varlen_attention",
    "length_buckets",
    "padded_layout",
    "varlen_attention_forward",
]

VARLEN_ATTENTION = "miles_varlen"


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[T] positions -> [n+1] int32 boundaries: a sequence starts wherever the position is not previous + 1."""
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = torch.nonzero(starts).reshape(-1)
    return torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)


# a bucket of sequences is padded to its longest one while that costs at most this much more attention work
# (sum of L_max^2 over the bucket vs sum of L_i^2); measured on CPU (2 cores, fp32, fwd+bwd), one padded SDPA
# over 32 sequences of ~90 tokens is ~4x faster than 32 per-sequence calls
PAD_WORK_LIMIT = 1.3


def length_buckets(lengths: list[int], pad_work_limit: float = PAD_WORK_LIMIT) -> list[list[int]]:
    """Sequence indices grouped longest first into buckets whose padded work (n * L_max^2) stays within
    `pad_work_limit` x their exact work (sum L_i^2). Empty sequences are left out."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    exact = 0
    for i in order:
        if buckets:
            bucket = buckets[-1]
            longest = lengths[bucket[0]]
            work = exact + lengths[i] ** 2
            if (len(bucket) + 1) * longest**2 <= pad_work_limit * work:
                bucket.append(i)
                exact = work
                continue
        buckets.append([i])
        exact = lengths[i] ** 2
    return buckets


@dataclass(frozen=True)
class PaddedBucket:
    """One bucket of `length_buckets` as gather indices into the packed row."""

    # [n * L] long: row of step j of the bucket's sequence i at i * L + j (pads read its first token)
    idx: torch.Tensor
    count: int  # n sequences
    longest: int  # L


@dataclass(frozen=True)
class PaddedLayout:
    """How the SDPA kernel lays a packed row's sequences out as right-padded batches (one per length bucket).

    It depends only on the sequence boundaries, so `forward_packed` builds it once per pack and every attention
    layer reuses it (pass it to the model as the `miles_layout` kwarg) instead of rebuilding the indices per layer.
    """

    bounds: tuple[int, ...]  # cu_seqlens of the row
    buckets: tuple[PaddedBucket, ...]
    # [T] long: where each row token's output lies in the buckets' padded outputs, flattened and concatenated
    out_idx: torch.Tensor


def padded_layout(bounds: list[int] | tuple[int, ...], device: torch.device | str) -> PaddedLayout:
    """The `PaddedLayout` of a row with sequence boundaries `bounds` (cu_seqlens), its index tensors on `device`."""
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    buckets = []
    out_idx = torch.zeros(bounds[-1] if bounds else 0, dtype=torch.long, device=device)
    offset = 0  # of the bucket in the concatenated padded outputs
    for bucket in length_buckets(lengths):
        longest = lengths[bucket[0]]
        starts = torch.tensor([bounds[i] for i in bucket], device=device)
        lens = torch.tensor([lengths[i] for i in bucket], device=device)
        steps = torch.arange(longest, device=device)
        valid = steps[None, :] < lens[:, None]  # [n, L]
        rows = starts[:, None] + steps[None, :]
        # pads read the sequence's first token
        buckets.append(
            PaddedBucket(torch.where(valid, rows, starts[:, None]).reshape(-1), len(bucket), longest)
        )
        padded_pos = offset + torch.arange(len(bucket) * longest, device=device).reshape(len(bucket), longest)
        out_idx[rows[valid]] = padded_pos[valid]
        offset += len(bucket) * longest
    return PaddedLayout(tuple(bounds), tuple(buckets), out_idx)


def _gather_bucket(x: torch.Tensor, b: PaddedBucket) -> torch.Tensor:
    """[B, h, T, D] -> [B*n, h, L, D]: the bucket's sequences, right-padded."""
    batch, heads, _, dim = x.shape
    g = x.index_select(2, b.idx).view(batch, heads, b.count, b.longest, dim)
    return g.transpose(1, 2).reshape(batch * b.count, heads, b.longest, dim)


def _sdpa_bucketed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PaddedLayout,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """query [B, H, T, D], key/value [B, Hkv, T, D] -> [B, H, T, D], causal within each sequence of `layout`.

    Sequences of similar length (`length_buckets`) are gathered into one right-padded batch per bucket and run
    through one causal SDPA call: a real query attends only to keys at or before it, all of its own sequence, so
    padding never enters a real row (padded rows are dropped). Each sequence computes what an unpacked forward
    would, up to the kernel's summation order (<= 1e-6 in fp32). Gathers and the final scatter are index_select
    (whose backward is index_add: pad positions receive exact zeros).
    """
    gqa = query.shape[1] != key.shape[1]
    batch, heads, _, dim = query.shape
    outs = []
    for b in layout.buckets:
        q, k, v = (_gather_bucket(x, b) for x in (query, key, value))  # [B*n, h, L, D]
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )  # [B*n, H, L, D]
        o = o.reshape(batch, b.count, heads, b.longest, dim).transpose(1, 2)
        outs.append(o.reshape(batch, heads, b.count * b.longest, dim))
    padded = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return padded.index_select(2, layout.out_idx)


_last_checked: tuple[weakref.ref[torch.Tensor], int] | None = None  # (boundaries tensor, its version)


def _check_cu_end(cu: torch.Tensor, t: int) -> None:
    """cu_seqlens must end at the row's length. Checked once per boundaries tensor: every layer of a forward gets
    the same one, and on CUDA each check is a device -> host sync that stalls the launch queue."""
    global _last_checked
    if _last_checked is not None and _last_checked[1] == cu._version and _last_checked[0]() is cu:
        return
    if int(cu[-1]) != t:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the packed row has {t} tokens")
    _last_checked = (weakref.ref(cu), cu._version)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None,
    miles_cp: CPShard | None = None,
    miles_layout: PaddedLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: query [B, H, T, D], key/value [B, Hkv, T, D] -> ([B, T, H, D], None).

    `miles_layout`: the row's `PaddedLayout`, built once per forward by the caller (built here when absent).

    Block-diagonal causal attention over the packed row (see the module docstring for where boundaries
    come from and which kernel runs); B is 1 for packs, or several rows sharing the same boundaries (an
    unpadded batch). Raises ValueError for an attention mask, a KV cache, cu_seq_lens_q with B > 1, or rows
    with different position_ids boundaries; NotImplementedError for sliding-window layers.
    """
    if attention_mask is not None:
        raise ValueError(
            "miles_varlen attention takes sequence boundaries from cu_seq_lens_q/position_ids, not an "
            f"attention_mask (got shape {tuple(attention_mask.shape)}); do not pass attention_mask"
        )
    if sliding_window is not None:
        raise NotImplementedError(
            f"miles_varlen does not implement sliding-window attention ({sliding_window})"
        )
    if miles_cp is not None:
        from miles.backends.fsdp_utils.context_parallel import cp_attention

        return cp_attention(query, key, value, miles_cp, scaling=scaling, dropout=dropout), None
    cu = _row_boundaries(query, key, cu_seq_lens_q, cu_seq_lens_k, position_ids)
    if use_flash_kernel(query):
        return _flash_varlen(query, key, value, cu, max_length_q, dropout, scaling), None
    bounds = tuple(cu.tolist())
    if miles_layout is None:
        miles_layout = padded_layout(bounds, query.device)
    elif miles_layout.bounds != bounds:
        raise ValueError(
            f"miles_layout was built for sequence boundaries {miles_layout.bounds[:8]}..., the row has {bounds[:8]}..."
        )
    out = _sdpa_bucketed(query, key, value, miles_layout, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


def _row_boundaries(
    query: torch.Tensor,
    key: torch.Tensor,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor:
    """The packed row's cu_seqlens [n+1] (from `cu_seq_lens_q`, else `position_ids`, else one sequence), checked
    against the row: self-attention (equal q/k boundaries, as many keys as queries), one boundary set for all rows."""
    if (
        cu_seq_lens_k is not None
        and cu_seq_lens_q is not None
        and cu_seq_lens_k is not cu_seq_lens_q  # forward_packed passes one tensor: no device sync per layer
        and not torch.equal(cu_seq_lens_q, cu_seq_lens_k)
    ):
        raise ValueError("miles_varlen packs self-attention: cu_seq_lens_q and cu_seq_lens_k must be equal")

    batch, _, t, _ = query.shape
    if key.shape[2] != t:
        raise ValueError(
            f"miles_varlen is for training forwards without a KV cache: {t} queries but {key.shape[2]} keys; "
            "call the model with use_cache=False"
        )
    if cu_seq_lens_q is not None:
        if batch != 1:
            raise ValueError(f"packed attention with cu_seq_lens_q expects one packed row, got batch {batch}")
        cu = cu_seq_lens_q
    elif position_ids is not None:
        rows = position_ids.reshape(-1, t)
        if rows.shape[0] > 1 and not bool((rows == rows[:1]).all()):
            raise ValueError(
                "miles_varlen needs the same sequence boundaries in every row; pack into one row"
            )
        cu = cu_seqlens_from_position_ids(rows[0])
    else:
        cu = torch.tensor([0, t], dtype=torch.int32)
    _check_cu_end(cu, t)
    return cu


def _flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_length_q: int | None,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """query [B, H, T, D], key/value [B, Hkv, T, D] -> [B, T, H, D] by the backend's flash varlen kernel, row by
    row (B > 1 only when every row has the same boundaries `cu`)."""
    flash_varlen = varlen_kernel()
    cu32 = cu.to(device=query.device, dtype=torch.int32)
    max_len = max_length_q or int((cu32[1:] - cu32[:-1]).max())
    outs = []
    for b in range(query.shape[0]):
        out = flash_varlen(
            query[b].transpose(0, 1),
            key[b].transpose(0, 1),
            value[b].transpose(0, 1),
            cu32,
            cu32,
            max_len,
            max_len,
            dropout,
            scaling,
        )
        outs.append(out)
    return torch.stack(outs)


def _varlen_mask(
    batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> None:
    """HF mask-interface hook: packed attention needs no mask; refuse padding masks instead of dropping them.

    Without a registered mask function HF would silently ignore a 2D padding mask for a custom attention.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "miles_varlen attention does not apply padding masks (attention_mask has zeros); pack the sequences "
            "(cu_seq_lens_q / position_ids) or switch the model back to 'sdpa' for padded batches"
        )
    return None


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)


def enable_varlen_attention(model: torch.nn.Module) -> None:
    """Switch an HF model (plain or FSDP2-wrapped, which is the same module) to "miles_varlen", its
    linear-attention layers (hybrid models) to one run per packed sequence. Idempotent."""
    if getattr(model.config, "_attn_implementation", None) != VARLEN_ATTENTION:
        model.set_attn_implementation(VARLEN_ATTENTION)
    segment_linear_attention(model)
