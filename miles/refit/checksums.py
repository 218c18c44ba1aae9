"""The trainer's side of the refit checksums: what each TP rank of an engine must report after a refit.

SGLang 0.5.23's ``/weights_checker`` (action ``checksum``) answers one entry per rank, each hashing that rank's
own parameters (`miles.utils.weight_checksum`): its tensor-parallel shard, under SGLang's names, where q/k/v are
one ``qkv_proj`` and gate/up one ``gate_up_proj`` (nothing is gathered). So the trainer computes, from each full
tensor it sends (while sending, bucket by bucket), the checksum of every rank's shard, cut as SGLang's parallel
layers cut it (`rank_shards`):

- column-parallel linears (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``; weight and bias):
  dim 0 in ``tp`` equal blocks; k/v with fewer KV heads than ranks: rank ``r`` holds KV head
  ``r // (tp // kv_heads)``; the fused parameter of a rank is its q, k, v (gate, up) blocks concatenated on dim 0;
- row-parallel linears (``o_proj``, ``down_proj``): the weight's dim 1 in ``tp`` equal blocks, the bias whole;
- vocab-parallel embeddings (``embed_tokens``, ``lm_head``): the rows zero-padded to a multiple of 64 (of
  ``64 * tp`` when the 64-padded count does not split evenly), then ``tp`` equal blocks;
- norms: whole on every rank.

At ``tp == 1`` every tensor is also hashed whole under its own name (the embedded engine's names), and the
embeddings either padded or not. At ``tp > 1`` a tensor of any other layout is not hashed (not comparable). Names
the engines report but the trainer lacks are not compared; at least one must be. After the first comparison
only the names the engine reported are hashed (``wanted``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from miles.refit.moe_names import split_bucket
from miles.utils.weight_checksum import tensor_checksum

FUSED = {  # HF linear -> (SGLang's fused linear, block index, blocks)
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
}
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
VOCAB_PAD = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class ShardSpec:
    """How an engine holds the weights: ``tp`` ranks, hashing with ``kind`` (`device_hash_kind` of its device);
    ``kv_heads``: the model's KV heads (None: unknown, then q/k/v are compared only at ``tp == 1``)."""

    tp: int = 1
    kind: str = "sha256"
    kv_heads: int | None = None


def _split(name: str) -> tuple[str, str, str]:
    """``model.layers.0.mlp.up_proj.weight`` -> (``model.layers.0.mlp.``, ``up_proj``, ``weight``)."""
    head, _, param = name.rpartition(".")
    prefix, _, leaf = head.rpartition(".")
    return (prefix + "." if prefix else ""), leaf, param


def _blocks(t: torch.Tensor, dim: int, tp: int) -> list[torch.Tensor] | None:
    if t.dim() <= dim or t.shape[dim] % tp:
        return None
    return list(torch.chunk(t, tp, dim=dim))


def _kv_blocks(t: torch.Tensor, tp: int, kv_heads: int) -> list[torch.Tensor] | None:
    """k/v shards when ``kv_heads < tp``: rank r holds head ``r // (tp // kv_heads)`` (replicated)."""
    if tp % kv_heads or t.shape[0] % kv_heads:
        return None
    rows = t.shape[0] // kv_heads
    return [t[(r // (tp // kv_heads)) * rows : (r // (tp // kv_heads) + 1) * rows] for r in range(tp)]


def vocab_blocks(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """A vocab-parallel tensor's shards: rows zero-padded as SGLang pads them, in ``tp`` equal blocks."""
    pad_to = VOCAB_PAD if -(-t.shape[0] // VOCAB_PAD) * VOCAB_PAD % tp == 0 else VOCAB_PAD * tp
    padded = -(-t.shape[0] // pad_to) * pad_to
    if padded != t.shape[0]:
        t = torch.cat([t, t.new_zeros((padded - t.shape[0], *t.shape[1:]))])
    return list(torch.chunk(t, tp, dim=0))


def rank_shards(name: str, t: torch.Tensor, spec: ShardSpec) -> list[torch.Tensor] | None:
    """Each TP rank's shard of HF tensor ``name`` as SGLang's layer of that name holds it (before fusing);
    None where the layout is not known at ``spec.tp > 1``."""
    tp = spec.tp
    _, leaf, param = _split(name)
    if leaf in FUSED:
        if leaf in ("k_proj", "v_proj") and tp > 1:
            if spec.kv_heads is None:
                return None
            if spec.kv_heads < tp:
                return _kv_blocks(t, tp, spec.kv_heads)
        return _blocks(t, 0, tp)
    if leaf in ROW_PARALLEL:
        return _blocks(t, 1, tp) if param == "weight" else [t] * tp
    if leaf in VOCAB_PARALLEL and t.dim() == 2:
        return vocab_blocks(t, tp)
    if tp == 1 or "norm" in leaf:
        return [t] * tp
    return None


class RefitChecksums:
    """The checksums every TP rank of an engine must report after a refit, accumulated tensor by tensor while
    the refit sends them (`add_bucket`). ``expected[r][name]``: the checksums rank ``r`` may report for ``name``
    (one; two for embeddings at ``tp == 1``, padded or not). ``seconds``: the time spent hashing;
    ``engine_seconds``: the time waited for the engines' checksums; ``reported``: the names they reported."""

    def __init__(self, spec: ShardSpec, wanted: set[str] | None = None) -> None:
        self.spec, self.wanted = spec, wanted
        self.expected: list[dict[str, set[str]]] = [{} for _ in range(spec.tp)]
        self._parts: dict[str, dict[int, list[torch.Tensor]]] = {}  # fused name -> block index -> rank shards
        self.seconds = self.engine_seconds = 0.0
        self.reported: set[str] = set()

    def _want(self, name: str) -> bool:
        return self.wanted is None or name in self.wanted

    def _record(self, rank: int, name: str, t: torch.Tensor) -> None:
        self.expected[rank].setdefault(name, set()).add(tensor_checksum(t, self.spec.kind))

    def add_bucket(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            for name, t in split_bucket(bucket):  # stacked experts under the per-expert names sent
                self._add(name, t)
        self.seconds += time.perf_counter() - start

    def _add(self, name: str, t: torch.Tensor) -> None:
        tp = self.spec.tp
        prefix, leaf, param = _split(name)
        if tp == 1 and self._want(name):  # the whole tensor under its own name
            self._record(0, name, t)
        if leaf in FUSED:
            fused, index, blocks = FUSED[leaf]
            self._add_block(f"{prefix}{fused}.{param}", index, blocks, rank_shards(name, t, self.spec))
        elif (tp > 1 or leaf in VOCAB_PARALLEL) and self._want(name):
            shards = rank_shards(name, t, self.spec)
            for r, shard in enumerate(shards or ()):
                self._record(r, name, shard)

    def _add_block(self, fused: str, index: int, blocks: int, shards: list[torch.Tensor] | None) -> None:
        """Keep block ``index`` of ``fused`` until all ``blocks`` are there, then hash each rank's
        concatenation (a block of unknown layout makes the fused tensor not comparable)."""
        if not self._want(fused):
            return
        parts = self._parts.setdefault(fused, {})
        parts[index if shards is not None else -1] = shards or []  # -1: the group is not comparable
        if -1 not in parts and len(parts) == blocks:
            for r in range(self.spec.tp):
                self._record(r, fused, torch.cat([parts[i][r] for i in range(blocks)]))
            del self._parts[fused]
