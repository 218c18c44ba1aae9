"""Variable-length (packed) attention for HF models, registered as the attention implementation "miles_varlen".

A pack is one row of several sequences; every token attends causally to the earlier tokens of its own
sequence only. Boundaries come from `cu_seq_lens_q` (HF's flash-attention kwarg name, passed to the model
forward) or, when absent, from `position_ids` restarting at 0; never from token values.

Kernels (`select_attention_kernel` maps --attn-implementation onto them; each name runs its own kernel):
- CPU (and CUDA with backend "sdpa"): sequences of similar length are gathered into right-padded batches and
  each batch is one `scaled_dot_product_attention(is_causal=True)` call (no Python loop per sequence; the
  padded work stays within `PAD_WORK_LIMIT` x sum(L_i^2)); each sequence computes what an unpacked forward
  would, up to summation order;
- backend "flash" (flash_attention_2; miles_varlen on CUDA): FlashAttention-2's `flash_attn_varlen_func`
  (package flash-attn, module `flash_attn`) over the whole row;
- backend "flash3" (flash_attention_3): FlashAttention-3's `flash_attn_varlen_func` (module
  `flash_attn_interface`, built from flash-attention's hopper/ directory; not on PyPI);
- context parallel (a `miles_cp` kwarg, see context_parallel.py): ring-flash-attn's llama3 varlen kernel with
  FlashAttention-2 on CUDA, all-gathered K/V with a block-diagonal causal mask in plain torch otherwise.

Because "miles_varlen" is not a mask-interface name, HF builds no 4D mask for it (`attention_mask` is None),
which is what a packed row needs. Select it with `enable_varlen_attention(model)`; `forward_packed` does so.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

if TYPE_CHECKING:
    from miles.backends.fsdp_utils.context_parallel import CPContext

__all__ = [
    "VARLEN_ATTENTION",
    "PaddedLayout",
    "cu_seqlens_from_position_ids",
    "enable_varlen_attention",
    "padded_layout",
    "select_attention_kernel",
    "set_varlen_backend",
    "use_flash_kernel",
    "varlen_attention_forward",
]

VARLEN_ATTENTION = "miles_varlen"
_BACKENDS = ("auto", "sdpa", "flash", "flash3")
_backend = os.environ.get("MILES_VARLEN_BACKEND", "auto")
_kernels: dict[
    str, Callable[..., torch.Tensor]
] = {}  # the backend's varlen kernel, imported once (_varlen_kernel)

# what each flash backend imports, and how to get it
FA2_MODULE, FA2_INSTALL = "flash_attn", "the flash-attn package: pip install 'miles[gpu]'"
FA3_MODULE, FA3_INSTALL = (
    "flash_attn_interface",
    "FlashAttention-3, which is not on PyPI: build it from flash-attention's hopper/ directory "
    "(cd hopper && pip install --no-build-isolation .)",
)


def set_varlen_backend(name: str) -> None:
    """Choose the kernel: "auto" (FlashAttention-2 on CUDA, SDPA on CPU), "sdpa" (always), "flash"
    (FlashAttention-2, CUDA only), "flash3" (FlashAttention-3, CUDA only).

    The default comes from the environment variable MILES_VARLEN_BACKEND, else "auto".
    """
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"varlen attention backend {name!r} is not one of {_BACKENDS}")
    _backend = name
    _kernels.clear()


def varlen_backend() -> str:
    """The backend chosen by `set_varlen_backend` (or MILES_VARLEN_BACKEND)."""
    return _backend


def use_flash_kernel(query: torch.Tensor) -> bool:
    """Whether the varlen kernels should run flash-attn (2 or 3) for `query` under the current backend choice."""
    if _backend in ("flash", "flash3") and not query.is_cuda:
        raise ValueError(f"MILES_VARLEN_BACKEND={_backend} needs CUDA tensors; use 'sdpa' or 'auto' on CPU")
    return _runs_flash(query.is_cuda)


def _runs_flash(is_cuda: bool) -> bool:
    return _backend in ("flash", "flash3") or (_backend == "auto" and is_cuda)


def select_attention_kernel(attn_implementation: str, is_cuda: bool, cp_size: int = 1) -> None:
    """--attn-implementation picks the kernel behind the packed (varlen) attention every training forward uses,
    and the packages it needs are imported now (at model build), so a missing one fails before the first step:

    - flash_attention_2 -> FlashAttention-2 varlen (`flash_attn`, the `gpu` extra), CUDA only;
    - flash_attention_3 -> FlashAttention-3 varlen (`flash_attn_interface`), CUDA only, no context parallelism
      (ring-flash-attn's kernels are FlashAttention-2's);
    - miles_varlen -> FlashAttention-2 on CUDA where installed, else torch's own flash varlen kernel
      (`torch.nn.attention.varlen`); SDPA on CPU; sdpa/eager -> bucketed SDPA.

    With cp_size > 1 and FlashAttention-2, context-parallel attention runs ring-flash-attn (imported here too).
    """
    if attn_implementation in ("flash_attention_2", "flash_attention_3"):
        if not is_cuda:
            raise ValueError(
                f"--attn-implementation {attn_implementation} needs a CUDA device; on CPU use "
                "--attn-implementation sdpa"
            )
        if attn_implementation == "flash_attention_3" and cp_size > 1:
            raise ValueError(
                "--attn-implementation flash_attention_3 has no context-parallel kernel (ring-flash-attn runs "
                "FlashAttention-2's); use flash_attention_2 with --context-parallel-size > 1"
            )
        set_varlen_backend("flash" if attn_implementation == "flash_attention_2" else "flash3")
    elif attn_implementation == "miles_varlen":
        set_varlen_backend("auto")
    else:
        set_varlen_backend("sdpa")
    if _runs_flash(is_cuda):
        _varlen_kernel()
        if cp_size > 1 and (_backend != "auto" or flash_attn_installed()):
            from miles.backends.fsdp_utils.context_parallel import import_ring_kernels

            import_ring_kernels()


VarlenKernel = Callable[..., torch.Tensor]


def flash_attn_installed() -> bool:
    """Whether FlashAttention-2 (`flash_attn`) is importable: already imported (or stood in for), else looked up
    without importing it."""
    if "flash_attn" in sys.modules:
        return sys.modules["flash_attn"] is not None
    return importlib.util.find_spec("flash_attn") is not None


def _import_flash_varlen() -> VarlenKernel:
    """The backend's varlen kernel as f(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale) -> out,
    causal (bottom-right aligned), q [Tq, H, D], k/v [Tk, Hkv, D]."""
    if _backend == "flash3":
        try:
            from flash_attn_interface import flash_attn_varlen_func as fa3_varlen
        except ImportError as e:
            raise ImportError(
                f"--attn-implementation flash_attention_3 runs FlashAttention-3 (module {FA3_MODULE}), which is "
                f"not importable ({e}); install {FA3_INSTALL}, or use flash_attention_2"
            ) from e

        def fa3(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale):  # type: ignore[no-untyped-def]
            if dropout_p:
                raise ValueError(f"FlashAttention-3 has no attention dropout (got {dropout_p})")
            out = fa3_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=True)
            return out[0] if isinstance(out, tuple) else out  # FA3 betas return (out, softmax_lse)

        return fa3
    try:
        from flash_attn import flash_attn_varlen_func as fa2_varlen
    except ImportError as e:
        # miles_varlen ("auto") takes torch's own flash varlen kernel where flash-attn is missing;
        # flash_attention_2 named means FlashAttention-2 run
        torch_varlen = torch_varlen_func() if _backend == "auto" else None
        if torch_varlen is not None:
            return torch_varlen
        raise ImportError(
            f"miles_varlen attention with FlashAttention-2 (module {FA2_MODULE}) on CUDA: not importable ({e}); "
            f"install {FA2_INSTALL} (or use --attn-implementation sdpa / MILES_VARLEN_BACKEND=sdpa)"
        ) from e

    def fa2(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale):  # type: ignore[no-untyped-def]
        return fa2_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True
        )

    return fa2


def torch_varlen_func() -> Callable[..., torch.Tensor] | None:
    """torch's built-in flash-attention varlen kernel as a `VarlenKernel` (causal; q/k/v [T, H, D], cu_seqlens,
    max lengths, `dropout_p`, `softmax_scale`), or None when this torch has none. Its signature changed between releases (`is_causal` vs `window_size`, `scale`, `enable_gqa`): the
    adapter passes what the installed one takes. GQA (fewer K/V heads) is native to the kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    params = inspect.signature(varlen_attn).parameters

    def call(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None):  # type: ignore[no-untyped-def]
        if dropout_p:
            raise ValueError(
                "torch's varlen attention has no dropout; use flash-attn or MILES_VARLEN_BACKEND=sdpa"
            )
        kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        if softmax_scale is not None:
            if "scale" not in params:
                raise ValueError("this torch's varlen_attn takes no scale; use flash-attn")
            kwargs["scale"] = softmax_scale
        if "enable_gqa" in params and q.shape[1] != k.shape[1]:
            kwargs["enable_gqa"] = True
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    return call


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
    if _last_checked is not None and _last_checked[0]() is cu and _last_checked[1] == cu._version:
        return
    if int(cu[-1]) != t:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the packed row has {t} tokens")
    _last_checked = (weakref.ref(cu), cu._version)


def _varlen_kernel() -> VarlenKernel:
    """`_import_flash_varlen` once per backend (each layer of every forward asks; a failed import or a signature
    inspection per layer costs host time the GPU waits for)."""
    kernel = _kernels.get(_backend)
    if kernel is None:
        kernel = _kernels[_backend] = _import_flash_varlen()
    return kernel


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
    miles_cp: CPContext | None = None,
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

    if use_flash_kernel(query):
        flash_varlen = _varlen_kernel()
        cu32 = cu.to(device=query.device, dtype=torch.int32)
        max_len = max_length_q or int((cu32[1:] - cu32[:-1]).max())
        outs = []
        for b in range(batch):  # batch > 1 only when every row has the same boundaries
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
        return torch.stack(outs), None

    bounds = tuple(cu.tolist())
    if miles_layout is None:
        miles_layout = padded_layout(bounds, query.device)
    elif miles_layout.bounds != bounds:
        raise ValueError(
            f"miles_layout was built for sequence boundaries {miles_layout.bounds[:8]}..., the row has {bounds[:8]}..."
        )
    out = _sdpa_bucketed(query, key, value, miles_layout, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


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
    """Switch an HF model (plain or FSDP2-wrapped, which is the same module) to "miles_varlen". Idempotent."""
    if getattr(model.config, "_attn_implementation", None) != VARLEN_ATTENTION:
        model.set_attn_implementation(VARLEN_ATTENTION)
