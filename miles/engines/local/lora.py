"""LoRA adapters of the embedded engine, applied UNMERGED: SGLang 0.5.23's `/load_lora_adapter` (a PEFT
directory: ``adapter_config.json`` and ``adapter_model.safetensors``, tensors named
``base_model.model.<module>.lora_A.weight`` [r, in] / ``.lora_B.weight`` [out, r]), `/unload_lora_adapter`, and
the `lora_path` of a /generate request (the adapter's name; None: the base model).

The base weights are never touched. For the tokens of rows whose request names an adapter, each adapted projection
of `PoolRunner` adds ``scaling * (x A^T) B^T`` to its output (``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``), the same order of operations as the trainer's `LoRALinear`; the
other tokens of the same forward stay base. Only the projections `PoolRunner` runs itself can be adapted
(q/k/v/o, gate/up/down of the SiLU MLP); any other target module is refused at load.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn

    from miles.engines.local.scheduler import BatchRow

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# the runner's projections: (name of the call in `LoraBatch.add`, module suffixes in column order)
PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate": ("mlp.gate_proj",),
    "up": ("mlp.up_proj",),
    "down": ("mlp.down_proj",),
}


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: its name, where it came from, its scale and {HF module name: (A, B)}."""

    name: str
    path: str
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_peft_dir(path: str) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config, {module: (A, B)}) of a PEFT adapter directory; ValueError naming what is missing."""
    from safetensors.torch import load_file

    config_file, weights_file = (
        os.path.join(path, ADAPTER_CONFIG_FILE),
        os.path.join(path, ADAPTER_WEIGHTS_FILE),
    )
    for f in (config_file, weights_file):
        if not os.path.isfile(f):
            raise ValueError(f"lora_path {path!r}: no {os.path.basename(f)} (a PEFT adapter directory)")
    with open(config_file) as fh:
        config = json.load(fh)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(weights_file).items():
        if not name.startswith(PEFT_PREFIX) or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"lora_path {path!r}: tensor {name!r} is not a PEFT LoRA weight")
        module, part, _ = name[len(PEFT_PREFIX) :].rsplit(".", 2)
        pairs.setdefault(module, {})[part] = t
    incomplete = sorted(m for m, p in pairs.items() if set(p) != {"lora_A", "lora_B"})
    if incomplete:
        raise ValueError(f"lora_path {path!r}: modules without both lora_A and lora_B: {incomplete[:5]}")
    return config, {m: (p["lora_A"], p["lora_B"]) for m, p in pairs.items()}


class LoraAdapters:
    """The adapters an engine holds, by name; checked against the model's projections at load."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        layers = getattr(model.model, "layers", [])  # none on a VL model (no LoRA there: vl_runner)
        self.shapes = {
            f"model.layers.{i}.{suffix}": tuple(layer.get_submodule(suffix).weight.shape)
            for i, layer in enumerate(layers)
            for suffixes in PROJECTIONS.values()
            for suffix in suffixes
            if _has(layer, suffix)
        }
        self.loaded: dict[str, Adapter] = {}

    def load(self, name: str, path: str) -> Adapter:
        if not name:
            raise ValueError("lora_name must be a non-empty string")
        if name in self.loaded:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {self.loaded[name].path!r})")
        config, modules = read_peft_dir(path)
        r, alpha = int(config["r"]), float(config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights = {}
        for module, (a, b) in sorted(modules.items()):
            if module not in self.shapes:
                raise ValueError(
                    f"lora_path {path!r}: module {module!r} is not a projection this engine adapts "
                    f"(q/k/v/o_proj, gate/up/down_proj of model.layers.N)"
                )
            out_f, in_f = self.shapes[module]
            if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
                raise ValueError(
                    f"lora_path {path!r}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; expected "
                    f"({r}, {in_f}) and ({out_f}, {r})"
                )
            weights[module] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        adapter = Adapter(name, path, scaling, weights)
        self.loaded[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.loaded)}")
        del self.loaded[name]

    def check(self, names: Iterable[str | None]) -> None:
        """ValueError naming the first `lora_path` that is not loaded (None: the base model)."""
        for name in names:
            if name is not None and name not in self.loaded:
                raise ValueError(
                    f"lora_path {name!r} is not a loaded LoRA adapter; loaded: {sorted(self.loaded)}"
                )

    def for_rows(self, decode: list[BatchRow], buckets: list[list[BatchRow]]) -> LoraBatch | None:
        """The adapters of one packed forward (decode rows, one token each, then the prompt buckets' tokens, in
        `PoolRunner._pack`'s order); None when no row names one."""
        per_token: list[str | None] = [r.req.lora_path for r in decode]
        for r in (r for bucket in buckets for r in bucket):
            per_token += [r.req.lora_path] * len(r.token_ids)
        if not any(per_token):
            return None
        groups = []
        for name in sorted({n for n in per_token if n is not None}):
            if name not in self.loaded:  # the engine refuses to unload an adapter a request holds
                raise RuntimeError(f"LoRA adapter {name!r} was unloaded while a request used it")
            idx = [i for i, n in enumerate(per_token) if n == name]
            rows: slice | torch.Tensor = (
                slice(None) if len(idx) == len(per_token) else torch.tensor(idx, device=self.device)
            )
            groups.append((self.loaded[name], rows))
        return LoraBatch(groups, self.shapes)


def _has(layer: nn.Module, suffix: str) -> bool:
    try:
        layer.get_submodule(suffix)
    except AttributeError:
        return False
    return True


class LoraBatch:
    """The adapter deltas of one forward: for each adapter, the packed tokens it applies to."""

    def __init__(
        self, groups: list[tuple[Adapter, slice | torch.Tensor]], shapes: dict[str, tuple[int, ...]]
    ) -> None:
        self.groups, self.shapes = groups, shapes  # shapes: [out, in] of every projection, by module name

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the projection's output [N, out], in place) plus each adapter's ``scaling * (x A^T) B^T`` on
        its tokens, for the modules of `projection` (a key of PROJECTIONS) it adapts."""
        for adapter, rows in self.groups:
            xs = x[rows]
            col = 0
            for suffix in PROJECTIONS[projection]:
                module = f"model.layers.{layer}.{suffix}"
                width = self.shapes[module][0]  # its columns in the (fused) output
                pair = adapter.modules.get(module)
                if pair is not None:
                    a, b = pair
                    delta = F.linear(F.linear(xs, a), b) * adapter.scaling
                    target = out[:, col : col + width]
                    if isinstance(rows, slice):
                        target.add_(delta)
                    else:
                        target.index_add_(0, rows, delta)
                col += width
        return out
