"""The weight window's layout: what the trainer (`miles.refit.window`) and the embedded engine
(`miles.engines.local.window`, `miles.engines.local.control`) both read, so neither side imports the other.

A window is one file in shared memory holding every engine parameter in a flat buffer of the engine's dtype;
`WindowLayout` says where each parameter lives (offset, shape, stride in elements; regions 64-byte aligned, see
`align_elements`) and which names it accepts. The engine plans it (`miles.engines.local.window.plan_layout`) and
serves it as JSON (`/weight_window_layout`, `to_json`); the trainer rebuilds it (`from_json`), creates the file and
writes the views; the engine maps the file (`MappedWindow`, only `WINDOW_PREFIX` files) and points its parameters at
the views. The layout's digest travels with every update, so a trainer that wrote another layout is refused
instead of loading garbage.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass

import torch

from miles.utils.types import JSON

ALIGN_BYTES = 64  # every region of a window starts at a multiple of this many bytes
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


def align_elements(n: int, itemsize: int) -> int:
    """``n`` elements of ``itemsize`` bytes rounded up to the next `ALIGN_BYTES` boundary (in elements)."""
    step = max(1, ALIGN_BYTES // itemsize)
    return (n + step - 1) // step * step


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
