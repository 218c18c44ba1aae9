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

The layout both sides read (`WindowLayout`, `MappedWindow`, `WINDOW_PREFIX`) lives in `miles.refit.window_layout`;
this module plans it from the engine's parameters. The trainer's side is `miles.refit.window`.
"""

from __future__ import annotations

import torch

from miles.engines.local.fused import FusedLinear
from miles.refit.window_layout import WindowEntry, WindowLayout, align_elements


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
        start = align_elements(size, dtype.itemsize)
        for name, row in zip(names, group.offsets, strict=True):
            assert name is not None  # row blocks of one [out, in] buffer: the trainer writes plain copies
            rows = (shapes[name][0], group.in_features)  # allocated rows (the weight is empty while released)
            entries.append(WindowEntry(name, start + row * group.in_features, rows, (group.in_features, 1)))
            placed.add(name)
        size = start + group.in_features * group.out_features
        if group.biases is not None:
            start = align_elements(size, dtype.itemsize)
            for b, col in zip(group.biases, group.offsets, strict=True):
                name = by_id[id(b)]
                entries.append(WindowEntry(name, start + col, (shapes[name][0],), (1,)))
                placed.add(name)
            size = start + group.out_features
    for name in params:
        if name in placed:
            continue
        start = align_elements(size, dtype.itemsize)
        shape: tuple[int, ...] = tuple(shapes[name])
        stride = tuple(torch.empty(shape, device="meta").stride())
        entries.append(WindowEntry(name, start, shape, stride))
        size = start + torch.Size(shape).numel()
    return WindowLayout(dtype, align_elements(size, dtype.itemsize), entries, dict(aliases))
