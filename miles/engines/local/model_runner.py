"""Forward passes for the embedded engine: per-request KV caches and one batched decode step.

`CachedRunner` reuses the submodules of a loaded HF causal LM of the Llama family (Llama, Qwen2, Qwen3: token
embedding, per-layer q/k/v/o projections, optional q/k RMS norms, rotary embedding, MLP, norms, lm_head) and keeps
its own KV cache per request, so a decode step over requests of different lengths is one padded, masked
attention per layer. `NoCacheRunner` is the fallback for other architectures: a full forward per request per step.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class KVCache:
    """Keys and values of one request: [num_layers, kv_heads, capacity, head_dim] each; `length` tokens valid."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 64):
        self.k = torch.zeros(num_layers, kv_heads, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for `n` more tokens (capacity doubles, so appends are amortised O(1))."""
        need = self.length + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        k = torch.zeros(*self.k.shape[:2], cap, self.k.shape[3], dtype=self.k.dtype)
        v = torch.zeros_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v


class Runner(Protocol):
    """What the scheduler needs from a model runner."""

    uses_kv_cache: bool

    def new_cache(self) -> object: ...

    def prefill(self, input_ids: list[int], cache: object) -> torch.Tensor: ...

    def decode(self, token_ids: list[int], caches: list[object]) -> torch.Tensor: ...


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def supports_kv_cache(model: nn.Module) -> tuple[bool, str]:
    """Whether `CachedRunner` can drive `model`; the reason when it cannot."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {config.model_type!r} not in {SUPPORTED_MODEL_TYPES}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False, f"non-full attention layers {sorted(set(layer_types))}"
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if inner is None or not hasattr(inner, attr):
            return False, f"model.model has no {attr!r}"
    if not hasattr(model, "lm_head"):
        return False, "no lm_head"
    return True, ""


class CachedRunner:
    """Batched prefill/decode with per-request KV caches over an HF Llama-family model's own modules."""

    uses_kv_cache = True

    def __init__(self, model: nn.Module):
        ok, why = supports_kv_cache(model)
        if not ok:
            raise ValueError(f"CachedRunner cannot drive this model: {why}")
        self.model = model
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def new_cache(self) -> KVCache:
        """An empty KV cache for one request."""
        return KVCache(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    @torch.no_grad()
    def prefill(self, input_ids: list[int], cache: KVCache) -> torch.Tensor:
        """Run the prompt through the model, fill `cache`; returns fp32 logits of the last position, [V]."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        return self._forward(ids, [cache])[0, -1]

    @torch.no_grad()
    def decode(self, token_ids: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One new token per request (each appended to its own cache); returns fp32 logits [B, V]."""
        ids = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
        return self._forward(ids, caches)[:, 0]

    def _forward(self, ids: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """ids: [B, T] new tokens of each request (T > 1 only when B == 1). Returns fp32 logits [B, T, V]."""
        bsz, t = ids.shape
        starts = torch.tensor([c.length for c in caches], dtype=torch.long)
        for c in caches:
            c.reserve(t)
        positions = starts[:, None] + torch.arange(t)[None, :]  # [B, T]
        total = int(starts.max()) + t
        # key j is visible to query (i, s) when j <= starts[i] + s; this also hides the padding of short rows
        keys = torch.arange(total)
        mask = keys[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, total]

        inner = self.model.model
        hidden = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        for li, layer in enumerate(inner.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q = attn.q_proj(x).view(bsz, t, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(bsz, t, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(bsz, t, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys_b = torch.zeros(bsz, self.kv_heads, total, self.head_dim, dtype=k.dtype)
            vals_b = torch.zeros_like(keys_b)
            for i, c in enumerate(caches):
                s = c.length
                c.k[li, :, s : s + t] = k[i]
                c.v[li, :, s : s + t] = v[i]
                keys_b[i, :, : s + t] = c.k[li, :, : s + t]
                vals_b[i, :, : s + t] = c.v[li, :, : s + t]
            out = F.scaled_dot_product_attention(
                q,
                keys_b,
                vals_b,
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=self.kv_heads != self.num_heads,
            )
            out = attn.o_proj(out.transpose(1, 2).reshape(bsz, t, self.num_heads * self.head_dim))
            hidden = residual + out
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        for c in caches:
            c.length += t
        return self.model.lm_head(inner.norm(hidden)).float()


class TokenHistory:
    """The 'cache' of `NoCacheRunner`: just the tokens seen so far."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)


class NoCacheRunner:
    """Fallback for architectures `CachedRunner` does not know: a full forward of the whole sequence per step."""

    uses_kv_cache = False

    def __init__(self, model: nn.Module):
        self.model = model

    def new_cache(self) -> TokenHistory:
        """An empty token history for one request."""
        return TokenHistory()

    @torch.no_grad()
    def prefill(self, input_ids: list[int], cache: TokenHistory) -> torch.Tensor:
        """Full forward over the prompt; returns fp32 logits of the last position, [V]."""
        cache.tokens.extend(input_ids)
        return self._last_logits(cache.tokens)

    @torch.no_grad()
    def decode(self, token_ids: list[int], caches: list[TokenHistory]) -> torch.Tensor:
        """Full forward per request; returns fp32 logits [B, V]."""
        rows = []
        for tok, c in zip(token_ids, caches):
            c.tokens.append(tok)
            rows.append(self._last_logits(c.tokens))
        return torch.stack(rows)

    def _last_logits(self, tokens: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False)
        return out.logits[0, -1].float()


def make_runner(model: nn.Module) -> CachedRunner | NoCacheRunner:
    """The KV-cache runner when the architecture is supported, else the no-cache fallback (logged)."""
    ok, why = supports_kv_cache(model)
    if ok:
        return CachedRunner(model)
    logger.warning(
        "embedded engine: no KV-cache runner for this model (%s); using a full forward per step", why
    )
    return NoCacheRunner(model)
