"""Forward passes of the embedded engine: one batch (prefill chunks and decode tokens together) per call.

`PoolRunner` drives an HF causal LM of the Llama family (Llama, Qwen2, Qwen3, and Qwen3-MoE, whose sparse MoE
blocks run as HF's modules on the packed tokens: routing is per token; `routing_capture.py` records it) with its own
modules (embedding, per-layer norms, q/k/v/o projections, optional q/k norms, rotary embedding, MLP, final norm,
lm_head) and keeps keys/values in a `KVPool`. The tokens of all rows are packed into one sequence for every matmul
(q/k/v in one matmul, gate and up one each: two 512x1536 matmuls beat one 512x3072 on CPU; see `fused.py`);
attention runs per group of rows against the pool in place:
- decode rows (one new token each) attend over `pool[:length, slots]` in place: on CPU in float32 by the C
  kernel of `cpu_attention.py` (about 2.5x faster than matmuls); else as a view when their slots are contiguous
  (the scheduler keeps them so), with grouped-query heads folded into the query dimension, two batched matmuls
  and a softmax (cheaper than the fused attention op for one query per row);
- prompt rows (several tokens) are padded to the longest among them and attend causally to their slot's cached
  prefix plus themselves.
`NoCacheRunner` is the fallback for other architectures (Qwen3-Next among them, see `full_forward.py`): a full
forward over each row's whole sequence.
Both are device-agnostic (the pool lives on the model's device); only the logits of sampling rows come back.
LoRA adapters (`lora.py`) add their deltas, unmerged, to the projections of the rows that name one.

On CPU in float32, given the engine's `WeightStore`, `PoolRunner` multiplies by oneDNN-packed copies of the
layers' projections (`fused.py`; those of at least `PACK_MIN_ELEMENTS` weights: below, oneDNN's per-call overhead
outweighs its gain): packed at the first forward after every change the store reports, dropped at the change.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from miles.engines.local import cpu_attention
from miles.engines.local.full_forward import NoCacheRunner
from miles.engines.local.fused import FusedLinear
from miles.engines.local.kv_pool import KVPool
from miles.engines.local.scheduler import Batch, BatchRow

if TYPE_CHECKING:
    from miles.engines.local.lora import LoraAdapters, LoraBatch
    from miles.engines.local.routing_capture import PoolRouting
    from miles.engines.local.weights import WeightStore

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# weights of a projection from which its CPU matmul runs on a oneDNN-packed copy (hidden 512: 2^18 and more, 1.2-1.7x
# faster per matmul; hidden 64, the quickstart model: 2^13, slower)
PACK_MIN_ELEMENTS = 1 << 16


def supports_kv_cache(model: nn.Module) -> tuple[bool, str]:
    """Whether `PoolRunner` can drive `model`; the reason when it cannot."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {config.model_type!r} not in {SUPPORTED_MODEL_TYPES}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False, f"non-full attention layers {sorted(set(layer_types))}"
    if not layer_types and getattr(config, "use_sliding_window", False):  # Qwen3-MoE has no layer_types
        return False, "sliding-window attention"
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if inner is None or not hasattr(inner, attr):
            return False, f"model.model has no {attr!r}"
    assert inner is not None  # the loop returned otherwise
    if not hasattr(model, "lm_head"):
        return False, "no lm_head"
    if not hasattr(inner.norm, "variance_epsilon"):
        return False, f"norm {type(inner.norm).__name__} is not an RMSNorm with variance_epsilon"
    attn = inner.layers[0].self_attn
    if len({getattr(attn, n).bias is None for n in ("q_proj", "k_proj", "v_proj")}) != 1:
        return False, "some of the q/k/v projections have a bias, others not"
    return True, ""


def _rms_normalize(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x / rms(x) over the last dimension, times `weight` when given: HF's RMSNorm, bitwise equal to it in float32.

    On CPU in float32 as HF writes it, in four ops: `F.rms_norm` dispatches about twenty there (dtype casts,
    scalar copies around pow, mean, add, rsqrt, mul) and allocates one more activation-sized tensor, which at
    decode sizes ([64, 512]) costs more than the arithmetic (25M model, batch-64 decode: 3-6% more tokens/s
    this way). Elsewhere (CUDA's fused kernel, half-precision upcasts) `F.rms_norm`.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = x * x.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    return y if weight is None else y.mul_(weight)


@dataclass(slots=True)
class _Norm:
    """The HF Llama-family RMSNorm (weight * x / rms(x)); bitwise equal to the module in float32."""

    weight: nn.Parameter
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_normalize(x, self.eps, self.weight)


@dataclass(slots=True)
class _Linear:
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class _LayerRefs:
    """What one decoder layer reads, looked up once: loads, releases and resumes of the weights change the data
    of these Parameter objects, never the objects."""

    input_norm: _Norm
    post_norm: _Norm
    qkv: FusedLinear
    q_norm: nn.Parameter | None  # per-head weights of Qwen3's q/k norms
    k_norm: nn.Parameter | None
    qk_eps: float
    o_proj: FusedLinear
    gate: FusedLinear | None  # None: not the SiLU-gated MLP (e.g. a MoE block), `mlp` runs as a module
    up: FusedLinear | None
    down: FusedLinear | None
    mlp: nn.Module
    scaling: float

    @classmethod
    def of(cls, layer: nn.Module, silu: bool) -> _LayerRefs:
        attn, mlp = layer.self_attn, layer.mlp
        # per layer: Qwen3-MoE mixes sparse MoE blocks and dense MLPs (`mlp_only_layers`)
        silu_mlp = silu and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        q_norm = getattr(attn, "q_norm", None)
        return cls(
            input_norm=_Norm(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            post_norm=_Norm(
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
            ),
            qkv=FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj]),
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if q_norm is None else attn.k_norm.weight,
            qk_eps=0.0 if q_norm is None else q_norm.variance_epsilon,
            o_proj=FusedLinear([attn.o_proj]),
            gate=FusedLinear([mlp.gate_proj]) if silu_mlp else None,
            up=FusedLinear([mlp.up_proj]) if silu_mlp else None,
            down=FusedLinear([mlp.down_proj]) if silu_mlp else None,
            mlp=mlp,
            scaling=float(attn.scaling),
        )

    def projections(self) -> list[FusedLinear]:
        """The layer's matmuls, in order (what a weight window lays out together)."""
        mlp = [p for p in (self.gate, self.up, self.down) if p is not None]
        return [self.qkv, self.o_proj, *mlp]


def _slot_selector(slots: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when `slots` are consecutive (attention reads the pool in place), else an index tensor."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, device=device)


def _shared_prompts(rows: list[BatchRow]) -> tuple[list[BatchRow], list[tuple[BatchRow, BatchRow]]]:
    """Split prompt rows into those to feed and (row, first) pairs of rows that feed, from position 0, the same
    tokens as an earlier row `first`: their keys/values are a copy of first's (same tokens at the same positions,
    nothing before them), and so are the logits after their last token. GRPO sends every prompt n-samples
    times, so this feeds each distinct prompt once (what SGLang's radix cache gets from its prefix tree)."""
    fed: list[BatchRow] = []
    same_as: list[tuple[BatchRow, BatchRow]] = []
    first_of: dict[tuple[str | int | None, ...], BatchRow] = {}
    for r in rows:
        if r.start != 0:
            fed.append(r)
            continue
        first = first_of.setdefault((r.req.lora_path, *r.token_ids), r)  # same adapter too
        if first is r:
            fed.append(r)
        else:
            same_as.append((r, first))
    return fed, same_as


def _pad_buckets(rows: list[BatchRow], slack: int = 64) -> list[list[BatchRow]]:
    """Split prompt rows into groups padded to their longest row, so that padding at most doubles a group's
    tokens (plus `slack`): one group in slot order when that already holds, else buckets of similar length."""

    def fits(group_len: int, longest: int, total: int) -> bool:
        return group_len * longest <= 2 * total + slack

    if not rows or fits(len(rows), max(len(r.token_ids) for r in rows), sum(len(r.token_ids) for r in rows)):
        return [rows] if rows else []
    buckets: list[list[BatchRow]] = []
    total = 0
    for r in sorted(rows, key=lambda r: len(r.token_ids)):
        n = len(r.token_ids)
        if buckets and fits(len(buckets[-1]) + 1, n, total + n):
            buckets[-1].append(r)
            total += n
        else:
            buckets.append([r])
            total = n
    return buckets


@dataclass
class _Packed:
    """One forward's tokens, packed (decode rows first, then prompt buckets), and what every layer needs."""

    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    kv_index: torch.Tensor  # [N] row of each token's keys/values (all KV heads) in a layer's pool viewed 2-D
    groups: list[_Group]  # attention groups, in packing order
    picked: torch.Tensor | None  # packed index of each sampling row's last token; None: all tokens, in order
    # (source slot, destination slot, tokens) to copy after the layers: prompt rows fed as a copy of an identical
    # row's keys/values instead of their own tokens (see `_shared_prompts`)
    copies: list[tuple[int, int, int]]
    last: dict[int, int]  # id(row) -> packed index of the row's last token (a shared prompt's: its first's)
    lora: LoraBatch | None = None  # the LoRA adapters of rows that name one (miles.engines.local.lora)


@dataclass
class _Group:
    """Attention metadata of a group of rows, shared by every layer of one forward."""

    num_rows: int
    tokens: int  # packed tokens of the group
    slots: slice | torch.Tensor
    key_len: int
    # decode: additive float32 [rows, 1, 1, key_len]; prompts: bool [rows, 1, group * q_len, key_len]; None: decode
    # by the CPU kernel (`lengths` says what each row sees)
    mask: torch.Tensor | None
    q_len: int  # padded query length (1 for decode)
    scatter: torch.Tensor | None  # packed token -> padded (row * q_len + t) index; None when not padded
    lengths: torch.Tensor | None = None  # decode by the kernel: int64 [rows] visible positions (position + 1)


class PoolRunner:
    """Batched prefill and decode over a Llama-family HF model, keys/values in a preallocated `KVPool`."""

    uses_kv_cache = True

    def __init__(
        self,
        model: nn.Module,
        num_slots: int,
        capacity: int,
        weights: WeightStore | None = None,
        pack_min_elements: int = PACK_MIN_ELEMENTS,
        decode_kernel: bool = False,
    ):
        """`weights`: the store the engine changes the parameters through; given on CPU in float32, large
        projections run on oneDNN-packed copies, refreshed after each change it reports (without it, none are
        packed: nothing would say when the copies are stale). `decode_kernel`: on CPU in float32, decode
        attention runs in `cpu_attention`'s kernel when it can be compiled and the thread count suits it."""
        ok, why = supports_kv_cache(model)
        if not ok:
            raise ValueError(f"PoolRunner cannot drive this model: {why}")
        self.model = model
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.kv_heads
        inner = model.model
        silu = getattr(cfg, "hidden_act", None) == "silu"
        self.layers = [_LayerRefs.of(layer, silu) for layer in inner.layers]
        self.final_norm = _Norm(inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = _Linear(model.lm_head.weight, model.lm_head.bias)
        emb = inner.embed_tokens.weight
        self.embedding = inner.embed_tokens.weight  # the Parameter (tied to lm_head's in some models)
        self.device = emb.device
        self.pool = KVPool(
            cfg.num_hidden_layers, num_slots, capacity, self.kv_heads, self.head_dim, emb.dtype, emb.device
        )
        self._arange = torch.arange(capacity, device=emb.device)
        # RoPE cos and sign-adjusted sin of every position, computed once by the model's own rotary module (each
        # entry is position * inv_freq, so a table row equals what a per-step call returns); rope types whose
        # frequencies depend on the sequence length are computed per step instead
        rotary = model.model.rotary_emb
        self._rope_table = None
        if getattr(rotary, "rope_type", "default") not in ("dynamic", "longrope"):
            self._rope_table = self._rope(self._arange, emb[:1]).contiguous()
        self._prepack: list[FusedLinear] = []
        if weights is not None and _onednn_packs(emb):
            sizes = ((p, p.in_features * p.out_features) for refs in self.layers for p in refs.projections())
            self._prepack = [p for p, n in sizes if n >= pack_min_elements]
            weights.on_change(self.drop_prepacked)
        self._prepacked = False
        self.adapters: LoraAdapters | None = None  # set by an engine serving LoRA adapters
        self.routing: PoolRouting | None = None  # MoE: experts recorded or perturbed (routing_capture.py)
        self.decode_attention: cpu_attention.DecodeAttention | None = None
        if decode_kernel and emb.device.type == "cpu" and emb.dtype == torch.float32:
            self.decode_attention = cpu_attention.load_decode_attention(
                self.kv_heads, self.group, self.head_dim
            )

    def active_decode_kernel(self) -> cpu_attention.DecodeAttention | None:
        """The CPU decode-attention kernel when decode steps use it now (loaded, and the thread count suits it)."""
        kernel = self.decode_attention
        return kernel if kernel is not None and cpu_attention.usable_now() else None

    # ------------------------------------------------------------------ packed weights
    def drop_prepacked(self) -> None:
        """Drop the packed copies (the weights changed or are released); the next forward packs them again."""
        for p in self._prepack:
            p.unpack()
        self._prepacked = False

    def forget_views(self) -> None:
        """Drop the weight views the projections keep between forwards (`FusedLinear.weight`): the engine calls
        it at every change of its `WeightStore`, so that released weights free their memory."""
        for refs in self.layers:
            for p in refs.projections():
                p.forget_views()

    def _prepack_weights(self) -> None:
        for p in self._prepack:
            p.pack()
        self._prepacked = True

    @property
    def prepacked_projections(self) -> int:
        """Projections whose matmul runs on a packed copy now."""
        return sum(p.packed is not None for p in self._prepack)

    # ------------------------------------------------------------------ memory
    def release_kv(self) -> None:
        """Free the KV pool's storage."""
        self.pool.release()

    def resume_kv(self) -> None:
        """Allocate the KV pool again."""
        self.pool.allocate()

    def kv_allocated_bytes(self) -> int:
        return self.pool.allocated_bytes()

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Apply the batch's KV moves, feed every row's tokens; returns fp32 logits [sample rows, V]."""
        if self.pool.released:
            raise RuntimeError("KV pool is released; resume_memory_occupation(kv_cache) first")
        if self._prepack and not self._prepacked:
            self._prepack_weights()
        for src, dst, length in batch.moves:
            self.pool.move(src, dst, length)
        packed = self._pack(batch)
        self.pool.ensure_initialized(max(g.key_len for g in packed.groups))
        hidden = F.embedding(packed.ids, self.embedding)  # [N, hidden]
        table = self._rope_table
        rope = (
            self._rope(packed.positions, hidden) if table is None else table.index_select(0, packed.positions)
        )
        cos, sin_signed = rope[:, :1], rope[:, 1:]  # [N, 1, D] each
        with nullcontext() if self.routing is None else self.routing.capture(batch, packed):
            for li, refs in enumerate(self.layers):
                hidden = self._layer(li, refs, hidden, cos, sin_signed, packed)
        for src, dst, length in packed.copies:
            self.pool.move(src, dst, length)
        if packed.picked is not None:
            hidden = hidden.index_select(0, packed.picked)
        return self.lm_head(self.final_norm(hidden)).float()

    def _pack(self, batch: Batch) -> _Packed:
        """Token ids, positions and pool indices of the batch, packed as decode rows then prompt buckets."""
        dev = self.device
        decode = [r for r in batch.rows if len(r.token_ids) == 1]
        prompts, same_as = _shared_prompts([r for r in batch.rows if len(r.token_ids) > 1])
        buckets = _pad_buckets(prompts)
        ids = [r.token_ids[0] for r in decode]
        pos_of = [r.start for r in decode]
        slot_of = [r.slot for r in decode]
        last = {id(r): i for i, r in enumerate(decode)}
        for r in (r for bucket in buckets for r in bucket):
            n = len(r.token_ids)
            ids += r.token_ids
            slot_of += [r.slot] * n
            pos_of += range(r.start, r.start + n)
            last[id(r)] = len(ids) - 1
        ids_t, positions, slots = torch.tensor([ids, pos_of, slot_of], device=dev).unbind(0)
        # row of (position, slot) in a layer's pool viewed as [capacity * slots, kv_heads * D]
        kv_index = positions * self.pool.num_slots + slots
        kernel = self.active_decode_kernel() is not None
        nd = len(decode)
        groups = [self._decode_group(decode, positions[:nd], slots[:nd], kernel)] if decode else []
        groups += [self._prefill_group(b) for b in buckets]
        # the logits wanted: last token of each sampling row, in batch order (the scheduler's order); a shared
        # prompt's copies take its logits
        for r, first in same_as:
            last[id(r)] = last[id(first)]
        picked = [last[id(r)] for r in batch.rows if r.sample]
        picked_t = (
            None if picked == list(range(len(ids))) else torch.tensor(picked, device=dev, dtype=torch.long)
        )
        copies = [(first.slot, r.slot, len(r.token_ids)) for r, first in same_as]
        lora = None if self.adapters is None else self.adapters.for_rows(decode, buckets)
        return _Packed(ids_t, positions, kv_index, groups, picked_t, copies, last, lora)

    def _layer(
        self,
        li: int,
        refs: _LayerRefs,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        packed: _Packed,
    ) -> torch.Tensor:
        """One decoder layer over the packed tokens; writes their keys/values into the pool."""
        n_tok, d, half, heads = hidden.shape[0], self.head_dim, self.head_dim // 2, self.num_heads
        lora, x_in = packed.lora, refs.input_norm(hidden)
        qkv = refs.qkv(x_in) if lora is None else lora.add(li, "qkv", x_in, refs.qkv(x_in))  # [N, (H+2KVH)*D]
        qk = qkv[:, : (heads + self.kv_heads) * d].view(n_tok, heads + self.kv_heads, d)
        v = qkv[:, (heads + self.kv_heads) * d :].view(n_tok, self.kv_heads, d)
        if refs.q_norm is not None:  # per-head RMSNorm of q and k: one normalisation, then each part's weight
            qk = _rms_normalize(qk, refs.qk_eps)
            qk[:, :heads].mul_(refs.q_norm)
            qk[:, heads:].mul_(refs.k_norm)
        qk = torch.addcmul(qk * cos, torch.roll(qk, half, -1), sin_signed)  # RoPE of q and k together
        q, k = qk[:, :heads], qk[:, heads:]
        pool_k, pool_v = self.pool.k[li], self.pool.v[li]
        row = self.kv_heads * d  # a token's keys (values) of every KV head: one contiguous row of the pool
        pool_k.view(-1, row).index_copy_(0, packed.kv_index, k.reshape(n_tok, row))
        pool_v.view(-1, row).index_copy_(0, packed.kv_index, v.reshape(n_tok, row))
        outs, offset = [], 0
        for g in packed.groups:
            outs.append(self._attend(g, q[offset : offset + g.tokens], pool_k, pool_v, refs.scaling))
            offset += g.tokens
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        hidden = refs.o_proj(out, residual=hidden)
        hidden = hidden if lora is None else lora.add(li, "o", out, hidden)
        x = refs.post_norm(hidden)
        if refs.gate is None or refs.up is None or refs.down is None:  # all or none
            return hidden + refs.mlp(x[None])[0]  # as a [1, N, hidden] batch: HF's MoE blocks want 3-D
        if lora is not None:  # the adapters' deltas enter before the SiLU and the product: unfused
            y = F.silu(lora.add(li, "gate", x, refs.gate(x))) * lora.add(li, "up", x, refs.up(x))
            return lora.add(li, "down", y, refs.down(y, residual=hidden))
        # down(silu(gate(x)) * up(x)), the Llama-family MLP; gate and up as two matmuls, not one over their
        # concatenation: each weight is half the size (on CPU, 512x1536 twice is ~15% faster than 512x3072); the
        # SiLU, the product and the residual add ride on the matmuls (fused when packed)
        return refs.down(refs.up.times(x, refs.gate.silu(x)), residual=hidden)

    def _rope(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[N, 2, D]: cos and sin_signed of each position. rotate_half(x) * sin == roll(x, D/2) * sin_signed
        (the first half of sin negated), with the same rounding."""
        cos, sin = self.model.model.rotary_emb(like, positions[None])
        half = self.head_dim // 2
        return torch.stack((cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)), dim=1)

    def _decode_group(
        self, rows: list[BatchRow], positions: torch.Tensor, slot_index: torch.Tensor, kernel: bool
    ) -> _Group:
        """Attention metadata of the decode rows; `positions`, `slot_index`: int64 [rows], packed by `_pack`."""
        key_len = max(r.start for r in rows) + 1
        if kernel:  # the kernel takes the slots as indices
            return _Group(len(rows), len(rows), slot_index, key_len, None, 1, None, positions + 1)
        visible = self._arange[:key_len][None, :] <= positions[:, None]  # [rows, key_len]
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=self.device).masked_fill_(
            ~visible, float("-inf")
        )
        slots = _slot_selector([r.slot for r in rows], self.device)
        return _Group(len(rows), len(rows), slots, key_len, mask[:, None, None, :], 1, None)

    def _prefill_group(self, rows: list[BatchRow]) -> _Group:
        dev = self.device
        lens = [len(r.token_ids) for r in rows]
        q_len = max(lens)
        key_len = max(r.start + n for r, n in zip(rows, lens))
        # query t of row i sits at position start_i + t (padding repeats the row's last position)
        t = torch.arange(q_len, device=dev)
        starts = torch.tensor([r.start for r in rows], device=dev)
        lens_t = torch.tensor(lens, device=dev)
        pos = starts[:, None] + torch.minimum(t[None, :], lens_t[:, None] - 1)  # [rows, q_len]
        mask = torch.arange(key_len, device=dev)[None, None, :] <= pos[:, :, None]  # [rows, q_len, key]
        mask = mask[:, None].expand(len(rows), self.group, q_len, key_len).reshape(len(rows), 1, -1, key_len)
        scatter = None
        if any(n != q_len for n in lens):
            scatter = torch.cat([torch.arange(n, device=dev) + i * q_len for i, n in enumerate(lens)])
        slots = _slot_selector([r.slot for r in rows], dev)
        return _Group(len(rows), sum(lens), slots, key_len, mask, q_len, scatter)

    def _attend(
        self, g: _Group, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention of one group. q: [tokens, H, D] packed; returns [tokens, H * D]."""
        rows, kvh, grp, d = g.num_rows, self.kv_heads, self.group, self.head_dim
        if g.lengths is not None:
            assert self.decode_attention is not None and isinstance(g.slots, torch.Tensor)
            return self.decode_attention(q, pool_k, pool_v, g.slots, g.lengths, g.key_len, scale)
        assert g.mask is not None  # only kernel-decoded groups have none
        # [rows, kvh, key_len, D], strided over the position-major pool; a view when slots is a slice
        keys = pool_k[: g.key_len, g.slots].permute(1, 2, 0, 3)
        vals = pool_v[: g.key_len, g.slots].permute(1, 2, 0, 3)
        if g.q_len == 1:  # one query per row: scores [rows, kvh, group, key_len], softmax in float32
            scores = torch.matmul(q.reshape(rows, kvh, grp, d) * scale, keys.transpose(-1, -2))
            probs = torch.softmax(scores.float().add_(g.mask), -1, dtype=torch.float32).to(vals.dtype)
            return torch.matmul(probs, vals).view(rows, -1)
        if g.scatter is None:
            padded = q.reshape(rows, g.q_len, self.num_heads, d)
        else:
            padded = q.new_zeros(rows * g.q_len, self.num_heads, d)
            padded.index_copy_(0, g.scatter, q)
            padded = padded.view(rows, g.q_len, self.num_heads, d)
        # [rows, q_len, H, D] -> [rows, kvh, group * q_len, D]: heads of one KV head share its keys
        qf = padded.permute(0, 2, 1, 3).reshape(rows, kvh, grp * g.q_len, d)
        out = F.scaled_dot_product_attention(qf, keys, vals, attn_mask=g.mask, scale=scale)
        out = out.reshape(rows, self.num_heads, g.q_len, d).permute(0, 2, 1, 3).reshape(rows * g.q_len, -1)
        return out if g.scatter is None else out.index_select(0, g.scatter)


def _onednn_packs(like: torch.Tensor) -> bool:
    """Whether weights like `like` get oneDNN-packed copies: float32 on CPU with oneDNN built in."""
    return like.device.type == "cpu" and like.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def make_runner(
    model: nn.Module,
    num_slots: int,
    capacity: int,
    weights: WeightStore | None = None,
    decode_kernel: bool = False,
) -> PoolRunner | NoCacheRunner:
    """The KV-pool runner when the architecture is supported, else the no-cache fallback (logged). `weights`,
    `decode_kernel`: see `PoolRunner`."""
    ok, why = supports_kv_cache(model)
    if ok:
        return PoolRunner(model, num_slots, capacity, weights, decode_kernel=decode_kernel)
    logger.warning(
        "embedded engine: no KV-cache runner for this model (%s); using a full forward per step", why
    )
    return NoCacheRunner(model)
