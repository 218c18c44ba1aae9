"""The weight window: the embedded engine's parameters as views of one shared-memory file the trainer writes.

A miles-only refit path (SGLang has no equivalent; the trainer uses it only when every engine answers
`/weight_window_layout`, i.e. is embedded). The engine describes where each of its parameters lives in a flat
buffer of its dtype, in a layout its compute uses as is: the blocks of a `FusedLinear` (q/k/v, gate/up, ...) are
consecutive row blocks of one `[out, in]` region (each a plain contiguous weight, so the trainer's write is a
memcpy; the fused matmul reads the region through a transposed operand), their biases consecutive pieces of one
vector, every other parameter a contiguous region of its own (regions 64-byte aligned). The trainer creates a file
of that size in shared memory once, writes every tensor into its view at each refit, and posts one
`/update_weights_from_window` (inside the weight-update session); the engine maps the file (once; again after a
restart) and points each parameter at its view: no copy on the engine side, and the fused buffers are already laid
out, so `FusedLinear.weight()` uses them as they are.

The layout's digest travels with every update, so a trainer that wrote another layout is refused instead of
loading garbage. The engine reads the window only between refits: the trainer writes it while the engine holds no
view of it (colocated runs release the weights before training; a fresh or restarted engine holds its own).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass

import torch

from miles.engines.local.fused import FusedLinear
from miles.utils.types import JSON

_ALIGN_BYTES = 64
WINDOW_PREFIX = "miles-weight-window-"  # the only files an engine maps


@dataclass(frozen=True)
class WindowEntry:
    """Where one parameter lives in the window (in elements of the window's dtype)."""

    name: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class WindowLayout:
    """Every canonical parameter of the engine, its aliases, the dtype and the size of the window."""

    dtype: torch.dtype
    numel: int
    entries: list[WindowEntry]
    aliases: dict[str, str]  # every accepted name -> canonical name

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_json(self) -> dict[str, JSON]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "numel": self.numel,
            "nbytes": self.nbytes,
            "entries": [
                {"name": e.name, "offset": e.offset, "shape": list(e.shape), "stride": list(e.stride)}
                for e in self.entries
            ],
            "aliases": {a: c for a, c in self.aliases.items()},
            "digest": self.digest(),
        }

    @classmethod
    def from_json(cls, d: dict[str, JSON]) -> WindowLayout:
        """The layout of a `to_json` object (from /weight_window_layout); ValueError naming a malformed field."""
        dtype = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"window dtype {d['dtype']!r} is not a torch dtype")
        raw_entries, aliases = d["entries"], d["aliases"]
        if not isinstance(raw_entries, list) or not isinstance(aliases, dict):
            raise ValueError("window layout: 'entries' must be a list and 'aliases' an object")
        entries = [_entry(e) for e in raw_entries]
        layout = cls(dtype, _json_int(d["numel"], "numel"), entries, {k: str(v) for k, v in aliases.items()})
        if "digest" in d and d["digest"] != layout.digest():
            raise ValueError("window layout digest does not match its entries")
        return layout

    def digest(self) -> str:
        """A hash of dtype, size and entries (computed once: every refit names it, on both sides)."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        body = [str(self.dtype), self.numel, [(e.name, e.offset, e.shape, e.stride) for e in self.entries]]
        return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:32]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Canonical name -> view of `flat` (a 1-D tensor of `numel` elements of `dtype`)."""
        if flat.dtype != self.dtype or flat.numel() != self.numel:
            raise ValueError(
                f"window of {flat.numel()} x {flat.dtype}, layout needs {self.numel} x {self.dtype}"
            )
        return {
            e.name: flat.as_strided(e.shape, e.stride, flat.storage_offset() + e.offset) for e in self.entries
        }


def _json_int(value: JSON, what: str) -> int:
    if not isinstance(value, int | float | str):
        raise ValueError(f"window layout: {what} {value!r} is not an integer")
    return int(value)


def _entry(e: JSON) -> WindowEntry:
    """One `entries` item of a layout's JSON."""
    if not isinstance(e, dict) or not isinstance(e["shape"], list) or not isinstance(e["stride"], list):
        raise ValueError(f"window layout entry {e!r} is not an object with list 'shape' and 'stride'")
    shape = tuple(_json_int(x, "shape") for x in e["shape"])
    stride = tuple(_json_int(x, "stride") for x in e["stride"])
    return WindowEntry(str(e["name"]), _json_int(e["offset"], "offset"), shape, stride)


def _align(n: int, itemsize: int) -> int:
    step = max(1, _ALIGN_BYTES // itemsize)
    return (n + step - 1) // step * step


def plan_layout(
    params: dict[str, torch.nn.Parameter],
    shapes: dict[str, tuple[int, ...]],
    aliases: dict[str, str],
    fused: list[FusedLinear],
    dtype: torch.dtype,
) -> WindowLayout:
    """The layout of `params` (canonical name -> Parameter, allocated shape in `shapes`): fused groups first, in
    `fused`'s order, then every other parameter in `params`' order."""
    by_id = {id(p): name for name, p in params.items()}
    entries: list[WindowEntry] = []
    placed: set[str] = set()
    size = 0
    for group in fused:
        names = [by_id.get(id(w)) for w in group.weights]
        if any(n is None or n in placed for n in names):
            continue  # not parameters of this store, or shared with another group: laid out plainly below
        start = _align(size, dtype.itemsize)
        for name, w, row in zip(names, group.weights, group.offsets, strict=True):
            assert name is not None  # row blocks of one [out, in] buffer: the trainer writes plain copies
            rows = (w.shape[0], group.in_features)
            entries.append(WindowEntry(name, start + row * group.in_features, rows, (group.in_features, 1)))
            placed.add(name)
        size = start + group.in_features * group.out_features
        if group.biases is not None:
            start = _align(size, dtype.itemsize)
            for b, col in zip(group.biases, group.offsets, strict=True):
                name = by_id[id(b)]
                entries.append(WindowEntry(name, start + col, (b.shape[0],), (1,)))
                placed.add(name)
            size = start + group.out_features
    for name in params:
        if name in placed:
            continue
        start = _align(size, dtype.itemsize)
        shape: tuple[int, ...] = tuple(shapes[name])
        stride = tuple(torch.empty(shape, device="meta").stride())
        entries.append(WindowEntry(name, start, shape, stride))
        size = start + torch.Size(shape).numel()
    return WindowLayout(dtype, _align(size, dtype.itemsize), entries, dict(aliases))


class MappedWindow:
    """The engine's mapping of a trainer's window file (kept across refits; dropped when the path changes)."""

    def __init__(self, path: str, layout: WindowLayout):
        if not os.path.isabs(path) or not os.path.basename(path).startswith(WINDOW_PREFIX):
            raise ValueError(f"weight window {path!r}: must be an absolute path to a {WINDOW_PREFIX}* file")
        if not os.path.isfile(path):
            raise ValueError(f"weight window {path!r} does not exist (the trainer creates it)")
        size = os.path.getsize(path)
        if size != layout.nbytes:
            raise ValueError(
                f"weight window {path!r} holds {size} bytes, the engine's layout needs {layout.nbytes}"
            )
        self.path = path
        flat = torch.from_file(path, shared=True, size=layout.numel, dtype=layout.dtype)
        self.views = layout.views(flat)
