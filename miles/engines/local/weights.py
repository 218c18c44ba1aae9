"""The embedded engine's parameters: loading named tensors, releasing and re-allocating their storage.

Names are those of the HF model's `named_parameters()` (tied weights answer to every alias, e.g. both
`model.embed_tokens.weight` and `lm_head.weight`; a VL model's also in the spelling SGLang's loaders take,
`model.X` / `visual.X` for `model.language_model.X` / `model.visual.X`: `miles.refit.vl_names`; a stacked MoE
expert tensor also as its per-expert pieces, SGLang's names: `miles.refit.moe_names`, assembled in place). After `resume()` every parameter is zero-filled and marked
*pending*; each loaded tensor clears its mark, and the engine refuses to generate until none is pending, so a refit
that misses a tensor is caught instead of silently sampling from zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import SupportsInt

import torch
from torch import nn

from miles.refit.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_named
from miles.refit.moe_names import expert_piece, piece_view
from miles.refit.vl_names import engine_name
from miles.utils.weight_checksum import device_hash_kind, tensor_checksum


class EngineNotReady(RuntimeError):
    """Generation was asked for while weights or KV cache are released, or weights are not fully reloaded."""


class WeightStore:
    """Owns the parameters of one model: name aliases, shapes, release/resume and the pending set."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._params: dict[str, nn.Parameter] = {}
        self._canonical: dict[str, str] = {}
        by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canon = by_id.setdefault(id(p), name)
            self._canonical[name] = canon
            self._params[canon] = p
        for name, canon in list(self._canonical.items()):  # a VL model also takes SGLang's loader names
            self._canonical.setdefault(engine_name(name), canon)
        self._meta = {n: (tuple(p.shape), p.dtype) for n, p in self._params.items()}
        self.device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self.released = False
        self.unloaded = False  # released before any weights were loaded (`release(unloaded=True)`)
        self.pending: set[str] = set()
        # a pending stacked expert tensor -> the (expert, block) pieces loaded since resume (done when all are)
        self._pieces: dict[str, set[tuple[int, int]]] = {}
        self._listeners: list[Callable[[], None]] = []  # told after every change of parameter data
        # canonical name -> {sent name: checksum} of the FP8 tensors it was last loaded from (weight, scales)
        self.fp8_checksums: dict[str, dict[str, str]] = {}

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every load, point_at, release and resume (e.g. to drop copies of the weights)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    @property
    def names(self) -> list[str]:
        """Canonical parameter names (one per distinct tensor)."""
        return list(self._params)

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """Canonical name -> Parameter."""
        return dict(self._params)

    @property
    def aliases(self) -> list[str]:
        """Every accepted name (canonical names and tied aliases)."""
        return list(self._canonical)

    def resolve(self, name: str) -> str:
        """Canonical name of `name`; ValueError when the model has no such parameter."""
        try:
            return self._canonical[name]
        except KeyError:
            raise ValueError(
                f"unknown parameter {name!r}; the model has {len(self._canonical)} names, e.g. "
                f"{sorted(self._canonical)[:4]}"
            ) from None

    def get(self, name: str) -> torch.Tensor:
        """The live tensor of parameter `name` (any alias)."""
        self.check_ready()
        return self._params[self.resolve(name)].data

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype the parameter has when allocated."""
        return self._meta[self.resolve(name)]

    def check_ready(self) -> None:
        """Raise EngineNotReady when released or when some tensors were not reloaded since resume."""
        if self.released:
            raise EngineNotReady("weights are released; call /resume_memory_occupation and refit first")
        if self.pending:
            some = sorted(self.pending)[:5]
            raise EngineNotReady(
                f"{len(self.pending)} weight tensors not loaded since resume_memory_occupation (e.g. {some}); "
                "a refit must send every tensor before generation"
            )

    def _target(self, name: str) -> tuple[str, tuple[int, int, int] | None]:
        """Canonical name of `name` and, for a per-expert piece of a stacked expert tensor, its
        ``(expert, block, blocks)`` (`miles.refit.moe_names.expert_piece`); ValueError for an unknown name."""
        piece = expert_piece(name) if name not in self._canonical else None
        if piece is None:
            return self.resolve(name), None
        stacked, expert, block, blocks = piece
        canon = self.resolve(stacked)
        shape, _ = self._meta[canon]
        if len(shape) != 3 or expert >= shape[0] or shape[1] % blocks:
            raise ValueError(
                f"unknown parameter {name!r}: {canon!r} of shape {shape} has no such expert piece"
            )
        return canon, (expert, block, blocks)

    def _piece_shape(self, canon: str, piece: tuple[int, int, int] | None) -> tuple[int, ...]:
        shape, _ = self._meta[canon]
        return shape if piece is None else (shape[1] // piece[2], shape[2])

    def validate(self, name: str, tensor: torch.Tensor) -> str:
        """Check name and shape of an incoming tensor; returns the canonical name."""
        canon, piece = self._target(name)
        shape = self._piece_shape(canon, piece)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, model has {shape}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name!r}: expected a floating tensor, got dtype {tensor.dtype}")
        return canon

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the parameters (cast to the model dtype). All are validated before any is copied.
        Block-FP8 weights (e4m3 with their ``_scale_inv``, `miles.refit.fp8`) are dequantized first; the
        checksums of the FP8 tensors as received are kept for `weights_checker` (`fp8_checksums`)."""
        if self.released:
            raise ValueError(
                "cannot load weights while they are released; call /resume_memory_occupation first"
            )
        named = list(named_tensors)
        received: list[tuple[str, torch.Tensor]] = []
        if any(t.dtype == FP8_DTYPE or n.endswith(SCALE_SUFFIX) for n, t in named):
            named, received = dequantize_named(named)
        items = [(self.validate(n, t), n, t) for n, t in named]
        for canon, name, t in items:
            self._copy_in(canon, name, t)  # casts, and copies across devices directly
            self.fp8_checksums.pop(canon, None)
        for name, t in received:
            canon = self.resolve(name.removesuffix(SCALE_SUFFIX))
            self.fp8_checksums.setdefault(canon, {})[name] = tensor_checksum(t, device_hash_kind(t.device))
        self._changed()
        return len(items)

    @torch.no_grad()
    def load_one(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one (already validated) tensor; used by the streaming distributed path."""
        canon = self.validate(name, tensor)
        self._copy_in(canon, name, tensor)
        self._changed()

    def _copy_in(self, canon: str, name: str, tensor: torch.Tensor) -> None:
        """Copy a validated tensor into parameter ``canon`` (a per-expert piece into its view of the stacked
        tensor); the parameter stops being pending when whole, or when all its pieces have arrived."""
        _, piece = self._target(name)
        self.unloaded = False
        if piece is None:
            self._storage(canon).copy_(tensor)
            self.pending.discard(canon)
            self._pieces.pop(canon, None)
            return
        expert, block, blocks = piece
        piece_view(self._storage(canon), expert, block, blocks).copy_(tensor)
        if canon in self.pending:
            done = self._pieces.setdefault(canon, set())
            done.add((expert, block))
            if len(done) == self._meta[canon][0][0] * blocks:
                self.pending.discard(canon)
                del self._pieces[canon]

    def point_at(self, views: dict[str, torch.Tensor]) -> int:
        """Make every parameter a view of the given tensors (canonical name -> tensor of its shape and dtype),
        without copying; all are checked before any is changed, and all must be given."""
        if self.released:
            raise ValueError(
                "cannot load weights while they are released; call /resume_memory_occupation first"
            )
        missing = sorted(set(self._params) - set(views))
        if missing:
            raise ValueError(f"weight window lacks {len(missing)} parameters, e.g. {missing[:4]}")
        for name, view in views.items():
            shape, dtype = self._meta[self.resolve(name)]
            if tuple(view.shape) != shape or view.dtype != dtype:
                raise ValueError(
                    f"{name!r}: window view {tuple(view.shape)} {view.dtype}, model has {shape} {dtype}"
                )
        for name, view in views.items():
            self._params[name].data = view
        self.unloaded = False
        self.pending.clear()
        self._pieces.clear()
        self.fp8_checksums.clear()
        self._changed()
        return len(views)

    def release(self, unloaded: bool = False) -> None:
        """Free the storage of every parameter (each becomes an empty tensor); buffers are kept. ``unloaded``:
        the parameters never held weights (an engine started released), so the next `resume` has nothing to
        re-allocate for: the loads that follow allocate what they write."""
        for p in self._params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.released = True
        self.unloaded = self.unloaded or unloaded
        self._changed()

    def _storage(self, canon: str) -> torch.Tensor:
        """The data of parameter ``canon`` to copy a whole tensor into, allocated (uninitialised) first when a
        `resume` without allocation left it empty."""
        p = self._params[canon]
        shape, dtype = self._meta[canon]
        if tuple(p.data.shape) != shape:
            p.data = torch.empty(shape, dtype=dtype, device=self.device)
        return p.data

    def resume(self, allocate: bool = True) -> None:
        """Mark every parameter pending until loaded; with ``allocate`` (unless `unloaded`: there was nothing
        to give back), re-allocate each zero-filled first (the
        memory is occupied again, as SGLang's resume does). Without, they stay empty until a load: an engine whose
        weights are views of a weight window gets them back as views, so zero-filled storage would be thrown
        away (on a 100 MB model: a memset and fresh pages, tens of ms per refit); a copying load allocates what
        it writes."""
        if not self.released:
            return
        if allocate and not self.unloaded:
            for name, p in self._params.items():
                shape, dtype = self._meta[name]
                p.data = torch.zeros(shape, dtype=dtype, device=self.device)
        self.released = False
        self.pending = set(self._params)
        self._pieces.clear()
        self._changed()

    def allocated_bytes(self) -> int:
        """Bytes currently held by parameter storage."""
        return sum(p.data.numel() * p.data.element_size() for p in self._params.values())


def _field(meta: object, key: str) -> object:
    return meta[key] if isinstance(meta, dict) else getattr(meta, key)


def _int_field(meta: object, key: str) -> int:
    value = _field(meta, key)
    if not isinstance(value, SupportsInt | str):
        raise ValueError(f"flattened_bucket metadata {key}={value!r} is not an integer")
    return int(value)


def unflatten_bucket(payload: object) -> list[tuple[str, torch.Tensor]]:
    """Named tensors of a flattened bucket (`load_format="flattened_bucket"`, SGLang's layout).

    payload: {"flattened_tensor": 1-D tensor, "metadata": [{name, shape, dtype, start_idx, end_idx, numel}]}
    (dicts or objects with those attributes). Offsets index the flat tensor; a uint8 flat tensor holds raw bytes
    of mixed dtypes, any other dtype must equal each entry's dtype.
    """
    if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
        got = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(
            f"flattened_bucket payload must be a dict with flattened_tensor and metadata, got {got}"
        )
    flat = payload["flattened_tensor"]
    out = []
    for meta in payload["metadata"]:
        name, dtype = str(_field(meta, "name")), _field(meta, "dtype")
        dims = _field(meta, "shape")
        if not isinstance(dims, Iterable):
            raise ValueError(f"flattened_bucket metadata of {name!r}: shape {dims!r} is not a list")
        shape = tuple(int(s) for s in dims)
        part = flat[_int_field(meta, "start_idx") : _int_field(meta, "end_idx")]
        if flat.dtype == torch.uint8 and dtype != torch.uint8:
            part = part.view(dtype)
        elif flat.dtype != dtype:
            raise ValueError(
                f"bucket entry {name!r}: dtype {dtype} differs from the flat tensor's {flat.dtype}"
            )
        out.append((name, part.reshape(shape)))
    return out
