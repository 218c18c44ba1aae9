"""Projections of the embedded engine's decoder layers, each one matmul: q/k/v together, o, gate, up, down.

`FusedLinear` keeps the weights of its `nn.Linear`s as column blocks of one `[in, out]` buffer (transposed
storage) and points each module's parameter at its block (a `[out_i, in]` view, stride `(1, out)`); biases are
consecutive pieces of one vector. Row blocks of one `[out, in]` buffer (each weight a plain contiguous block, as a
shared-memory weight window lays them out, see `window.py`) are used as they are, through a transposed operand. `x @ buffer` then computes every projection in one matmul without transposing
the weight (MKL's fastest path on CPU for decode-sized batches), and the HF modules, which compute the same
`x @ weight.T`, give bitwise the same results. Weight loads copy into the parameters in place, so they update
the buffer; nothing is kept apart from the parameters, so releasing them frees the memory. When a parameter got
storage of its own (weights released and resumed), the next `weight()` call lays the buffer out again.
"""

from __future__ import annotations

import torch
from torch import nn

# fewer rows (tokens) than this: MKL on the plain weights even when packed (one row, as in batch-1 decode: the
# packed matmul measured ~10% slower per decode step; from 8 rows on it is 1.2-1.7x faster)
PACKED_MIN_ROWS = 8


class FusedLinear:
    """One matmul for `linears` (same input): `forward(x)` is `cat([lin(x) for lin in linears], -1)`."""

    def __init__(self, linears: list[nn.Linear]):
        biases = [lin.bias is not None for lin in linears]
        if any(biases) and not all(biases):
            raise ValueError("FusedLinear needs a bias on all or none of its projections")
        # the Parameter objects stay the same when weights are loaded, released or resumed (only .data changes)
        self.weights = [lin.weight for lin in linears]
        self.biases = [lin.bias for lin in linears] if all(biases) else None
        self.in_features = self.weights[0].shape[1]
        self.offsets = []  # first column of each projection in the buffer
        start = 0
        for w in self.weights:
            self.offsets.append(start)
            start += w.shape[0]
        self.out_features = start
        self.packed: torch.Tensor | None = None  # oneDNN-blocked copy of the matrix (CPU), see `pack`
        # (where the parameters lay, the matrix and bias views) as `weight()` last made them: it runs at every
        # matmul, and the layout check and the views cost more than a decode-sized matmul, so they are made again
        # only when a pointer, stride or size moved (the views keep their storage alive, so a new one can never
        # reuse its address unnoticed); `forget_views` drops them so that released weights free their memory
        self._views: tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None] | None = None
        self.layout()

    @torch.no_grad()
    def layout(self) -> None:
        """Copy the weights into one `[in, out]` buffer (the biases into one vector); point each at its part."""
        first = self.weights[0]
        with torch.inference_mode(False):  # loads copy into these later, outside inference mode
            buf = torch.empty((self.in_features, self.out_features), dtype=first.dtype, device=first.device)
            for w, start in zip(self.weights, self.offsets):
                buf[:, start : start + w.shape[0]].copy_(w.data.t())
            for w, start in zip(self.weights, self.offsets):
                w.data = buf[:, start : start + w.shape[0]].t()
            if self.biases is not None:
                fused = torch.cat([b.data for b in self.biases])
                for b, start in zip(self.biases, self.offsets):
                    b.data = fused[start : start + b.shape[0]]

    def _orientation(self) -> str | None:
        """How the parameters are laid out now: "cols" (column blocks of one `[in, out]` buffer, what `layout`
        makes), "rows" (row blocks of one `[out, in]` buffer, what a weight window holds: each block is a plain
        contiguous weight), or None (neither: lay out again)."""
        first = self.weights[0]
        if first.numel() == 0:
            return None
        base, size = first.data_ptr(), first.element_size()
        if all(
            w.data_ptr() == base + start * size and w.stride() == (1, self.out_features)
            for w, start in zip(self.weights, self.offsets)
        ):
            orientation = "cols"
        elif all(
            w.data_ptr() == base + start * self.in_features * size and w.stride() == (self.in_features, 1)
            for w, start in zip(self.weights, self.offsets)
        ):
            orientation = "rows"
        else:
            return None
        storage = first.untyped_storage()
        end = base + self.in_features * self.out_features * size
        if not storage.data_ptr() <= base or end > storage.data_ptr() + storage.nbytes():
            return None
        if self.biases is not None:
            b0 = self.biases[0]
            if any(b.data_ptr() != b0.data_ptr() + s * size for b, s in zip(self.biases, self.offsets)):
                return None
            bstore = b0.untyped_storage()
            start, end = bstore.data_ptr(), bstore.data_ptr() + bstore.nbytes()
            if not start <= b0.data_ptr() or b0.data_ptr() + self.out_features * size > end:
                return None
        return orientation

    def _where(self) -> tuple[int, ...]:
        """Where the parameters' data lie (pointers, the first weight's strides and size): a `.data` swap (load
        into a window, release, resume) or a storage resized in place changes it."""
        first = self.weights[0]
        ptrs = [w.data_ptr() for w in self.weights]
        if self.biases is not None:
            ptrs += [b.data_ptr() for b in self.biases]
        return (*ptrs, *first.stride(), first.numel(), first.untyped_storage().nbytes())

    def _laid_out(self) -> bool:
        """Whether the parameters still are the blocks of one buffer (and the biases of one vector)."""
        return self._orientation() is not None

    def weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The `[in, out]` matrix (strided over the column or row buffer) and the bias `[out]` (None without
        bias), as views of the parameters."""
        views = self._views
        if views is not None and views[0] == self._where():
            return views[1], views[2]
        orientation = self._orientation()
        if orientation is None:
            self.layout()
            orientation = "cols"
        stride = (self.out_features, 1) if orientation == "cols" else (1, self.in_features)
        w = self.weights[0].as_strided((self.in_features, self.out_features), stride)
        b = None if self.biases is None else self.biases[0].as_strided((self.out_features,), (1,))
        self._views = (self._where(), w, b)
        return w, b

    def forget_views(self) -> None:
        """Drop the views `weight()` keeps (call when the weights change or are released)."""
        self._views = None

    def pack(self) -> None:
        """Copy the current weights into oneDNN's blocked layout (CPU only); `__call__` then multiplies by the
        copy until `unpack()`."""
        w, _ = self.weight()
        if w.device.type != "cpu":
            raise ValueError(f"FusedLinear.pack: oneDNN packing is for CPU weights, these are on {w.device}")
        # [out, in], the layout the reorder reads; no batch-size hint: one blocking serves every M
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous())

    def unpack(self) -> None:
        """Drop the packed copy and the kept views (the weights changed, or are released)."""
        self.packed = None
        self._views = None

    def _packed_bias(self) -> torch.Tensor | None:
        return self.weight()[1]

    def _use_packed(self, x: torch.Tensor) -> bool:
        return self.packed is not None and x.shape[0] >= PACKED_MIN_ROWS

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] -> [N, out], plus `residual` [N, out] when given (fused into the packed matmul)."""
        if self._use_packed(x):
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self._packed_bias(), "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.packed, self._packed_bias(), "add"
            )
        w, b = self.weight()
        out = torch.mm(x, w) if b is None else torch.addmm(b, x, w)
        return out if residual is None else out.add_(residual)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(self(x)), the SiLU fused into the packed matmul."""
        if self._use_packed(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self._packed_bias(), "swish", [], "")
        return torch.nn.functional.silu(self(x))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """self(x) * other ([N, out]), the product fused into the packed matmul."""
        if self._use_packed(x):
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, other, self.packed, self._packed_bias(), "mul"
            )
        return self(x).mul_(other)
