"""Refit names of MoE experts as SGLang 0.5.23's Qwen3-MoE / Qwen3-Next loaders take them (issue 28).

transformers 5 holds a layer's experts stacked (`Qwen3MoeExperts`, `Qwen3NextExperts`):
``<prefix>.experts.gate_up_proj`` of shape ``[E, 2I, H]`` (expert ``e``'s gate projection is rows ``[0, I)`` of
``gate_up_proj[e]``, its up projection rows ``[I, 2I)``: the forward is ``linear(x, gate_up_proj[e]).chunk(2)``)
and ``<prefix>.experts.down_proj`` of shape ``[E, H, I]`` (``linear(h, down_proj[e])``). SGLang's loaders map
checkpoint names through ``FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", E)``, i.e.
per-expert names ``<prefix>.experts.<e>.{gate,up,down}_proj.weight`` with HF's per-expert ``nn.Linear`` shapes
(``[I, H]`` gate/up, ``[H, I]`` down), and skip a name they do not know without a word. So a refit sends each
stacked tensor as its per-expert pieces (`split_bucket`: row views of the full tensor, no copy); the embedded
engine takes both spellings and assembles pieces into its stacked parameters (`expert_piece`,
`miles.engines.local.weights`), and reports its checksums per piece, under the names sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>gate_up_proj|down_proj)$")
_PIECE = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj)\.weight$"
)
# per-expert leaf -> (stacked leaf, block index along dim 1 of an expert's slice, blocks)
_PIECES = {
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
    "down_proj": ("down_proj", 0, 1),
}


def is_stacked(name: str, t: torch.Tensor) -> bool:
    """Whether ``name`` is a stacked expert tensor (3-D ``...experts.gate_up_proj`` / ``...experts.down_proj``)."""
    return t.dim() == 3 and _STACKED.match(name) is not None


def split_stacked(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The per-expert tensors (SGLang's names, HF's per-expert shapes) of stacked expert tensor ``name``, in
    expert order (gate before up); anything else as ``[(name, t)]``. The pieces are views of ``t``."""
    m = _STACKED.match(name)
    if m is None or t.dim() != 3:
        return [(name, t)]
    prefix = m["prefix"]
    if m["leaf"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    if t.shape[1] % 2:
        raise ValueError(
            f"{name!r}: gate_up_proj of shape {tuple(t.shape)} has an odd dim 1 (2 * intermediate)"
        )
    half = t.shape[1] // 2
    out = []
    for e in range(t.shape[0]):
        out += [
            (f"{prefix}.{e}.gate_proj.weight", t[e, :half]),
            (f"{prefix}.{e}.up_proj.weight", t[e, half:]),
        ]
    return out


def split_bucket(bucket: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``bucket`` with every stacked expert tensor replaced by its per-expert pieces (`split_stacked`), in order."""
    return [piece for name, t in bucket for piece in split_stacked(name, t)]


def expert_piece(name: str) -> tuple[str, int, int, int] | None:
    """For a per-expert name ``<prefix>.experts.<e>.<leaf>.weight``: ``(stacked name, e, block, blocks)`` where
    the piece is block ``block`` of ``blocks`` equal blocks along dim 0 of ``stacked[e]``; None for other names."""
    m = _PIECE.match(name)
    if m is None:
        return None
    stacked_leaf, block, blocks = _PIECES[m["leaf"]]
    return f"{m['prefix']}.{stacked_leaf}", int(m["expert"]), block, blocks


def piece_view(stacked: torch.Tensor, expert: int, block: int, blocks: int) -> torch.Tensor:
    """The view of ``stacked`` (``[E, rows, cols]``) that piece ``(expert, block, blocks)`` is."""
    rows = stacked.shape[1] // blocks
    return stacked[expert, block * rows : (block + 1) * rows]
