"""LoRA adapters on the FSDP2 policy (--lora-rank): our own small module, not peft.

`LoRALinear` IS an ``nn.Linear`` (so the frozen base keeps its HF name ``...q_proj.weight``) with two extra
parameters ``lora_A`` [r, in] and ``lora_B`` [out, r] (B zero-initialised: the adapted model starts equal to the
base). ``y = x W^T + b + scaling * dropout(x) A^T B^T`` with ``scaling = alpha / r``. `apply_lora` swaps the
targeted Linears before FSDP2 sharding (every rank builds the same tree; rank 0's initial values are broadcast
with the rest of the weights), freezing everything but the adapters, so the optimizer holds adapter state only.

The base weights are never modified:
- the reference model is the base itself: `adapters_disabled(model)` switches the adapters off for the
  reference pass (no second copy of the weights);
- refits (and --save-hf) read `MergedView(model)`, whose state dict yields, under the base names, lazily merged
  tensors ``W + scaling * B @ A`` computed OUT OF PLACE into a new tensor when the weight updater materialises
  them (bucket by bucket, in the same order on every rank: the all-gathers are collective). lora_A / lora_B are
  not sent: engines need no LoRA support (--lora-refit merged);
- adapter-only refits (--lora-refit adapter, `miles.refit.lora_adapter`) read `BaseView(model)` once and
  `gathered_adapters(model)` at every refit: the engines apply the adapter unmerged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypedDict

import torch
from torch import nn

ALL_LINEAR = "all-linear"


class LoRALinear(nn.Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        rank: int,
        alpha: float,
        dropout: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if rank < 1:
            raise ValueError(f"--lora-rank={rank}: must be >= 1 for an adapter")
        self.rank = rank
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True
        self._new_adapters(device, dtype)

    def _new_adapters(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        """Fresh adapters: `initial_parameters` (left empty on the meta device)."""
        self.lora_A = nn.Parameter(torch.empty(self.rank, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, self.rank, device=device, dtype=dtype))
        if self.lora_A.device.type != "meta":
            with torch.no_grad():
                for name, value in self.initial_parameters().items():
                    self.get_parameter(name).copy_(value)

    def initial_parameters(self) -> dict[str, torch.Tensor]:
        """The adapters' initial values on CPU (fp32): A kaiming-uniform (drawn from the global RNG), B zero. A
        model built sharded (`build_fsdp_model`) takes rank 0's."""
        a = torch.empty(self.rank, self.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        return {"lora_A": a, "lora_B": torch.zeros(self.out_features, self.rank)}

    @classmethod
    def wrap(cls, base: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
        """A LoRALinear holding `base`'s own weight/bias parameters (shared, not copied), frozen."""
        w = base.weight
        # built on the meta device, so no throwaway base weight is allocated and initialised; then it takes
        # `base`'s parameters and gets its adapters where `base` lives
        layer = cls(base.in_features, base.out_features, base.bias is not None, rank, alpha, dropout, "meta")
        layer.weight = base.weight
        layer.bias = base.bias
        layer._new_adapters(w.device, w.dtype)
        layer.weight.requires_grad_(False)
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        a = self.lora_A.to(x.dtype)
        b = self.lora_B.to(x.dtype)
        return out + nn.functional.linear(nn.functional.linear(self.lora_dropout(x), a), b) * self.scaling


def _targeted(name: str, module: nn.Module, targets: list[str], lm_head: nn.Module | None) -> bool:
    if not isinstance(module, nn.Linear) or isinstance(module, LoRALinear) or module is lm_head:
        return False
    if ALL_LINEAR in targets:
        return True
    return name.rsplit(".", 1)[-1] in targets


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: list[str], dropout: float) -> int:
    """Swap every targeted nn.Linear of `model` for a `LoRALinear` and freeze all non-adapter parameters.
    Returns the number of adapted layers; ValueError (naming --lora-target-modules) when none matched."""
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = [(n, m) for n, m in model.named_modules() if _targeted(n, m, targets, lm_head)]
    if not found:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"--lora-target-modules={targets}: no nn.Linear matched; this model has {names}")
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear.wrap(module, rank, alpha, dropout))
    for pname, p in model.named_parameters():
        p.requires_grad_(pname.endswith(("lora_A", "lora_B")))
    return len(found)


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def adapter_parameter_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(("lora_A", "lora_B"))]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model (the LoRA run's reference): every adapter off inside the block."""
    layers = lora_layers(model)
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True


def _full(t: torch.Tensor) -> torch.Tensor:
    """All-gather a DTensor (collective) to a plain tensor; plain tensors pass through."""
    if hasattr(t, "full_tensor"):
        mesh_device = t.device_mesh.device_type
        if t.device.type != mesh_device:
            t = t.to(mesh_device)
        t = t.full_tensor()
    return t.detach()


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``w + scaling * b @ a`` as a NEW tensor in w's dtype, accumulated in fp32 (w is never written). The one
    formula of refits, --save-hf and the HF converter's merged export, so all three give the same bits."""
    delta = torch.matmul(b.float(), a.float()) * scaling
    return torch.add(w.float(), delta).to(w.dtype)


def merged_weight(layer: LoRALinear) -> torch.Tensor:
    """`merge` of a layer's full tensors. Collective when the layer is sharded (three all-gathers in a fixed
    order)."""
    return merge(_full(layer.weight), _full(layer.lora_A), _full(layer.lora_B), layer.scaling)


class _LazyMerged:
    """Stands in for a merged weight in a state dict until the weight updater materialises it: exposes the
    metadata the bucket plan reads (dtype, numel, is_floating_point) and computes the merged tensor on
    `detach()`, which is how the updater (`miles.refit.buckets.full_tensor`) turns a non-DTensor into data."""

    def __init__(self, layer: LoRALinear) -> None:
        self.layer = layer
        self.dtype = layer.weight.dtype
        self.shape = torch.Size((layer.out_features, layer.in_features))

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return True

    def detach(self) -> torch.Tensor:
        return merged_weight(self.layer)


class MergedView:
    """What refits and --save-hf read instead of the LoRA model: its state dict under the base (HF) names, with
    every adapted weight merged (lazily, see `_LazyMerged`) and the adapter parameters left out."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor | _LazyMerged]:
        merged = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoRALinear):
                merged[f"{name}.weight" if name else "weight"] = _LazyMerged(module)
        out: dict[str, torch.Tensor | _LazyMerged] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if name.endswith(("lora_A", "lora_B")):
                continue
            out[name] = merged.get(name, t)
        return out


class BaseView:
    """The LoRA model's frozen base under its HF names (adapters left out, nothing merged): what an adapter-only
    refit (--lora-refit adapter) sends once, to engines that do not hold the base yet."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        state = self.model.state_dict(keep_vars=True)
        return {n: t for n, t in state.items() if not n.endswith(("lora_A", "lora_B"))}


PEFT_PREFIX = "base_model.model."  # peft's tensor names: base_model.model.<module>.lora_A.weight


def gathered_adapters(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every adapter as a full CPU tensor under peft's name, cast to `dtype` (None: as trained). Collective when
    sharded (two all-gathers per layer, in module order on every rank)."""
    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LoRALinear):
            for part in ("lora_A", "lora_B"):
                t = _full(layer.get_parameter(part))
                out[f"{PEFT_PREFIX}{name}.{part}.weight"] = t.to("cpu", dtype or t.dtype).contiguous()
    return out


# ----------------------------------------------------------------------------------------------- checkpoints
# peft's file and field names, so that the adapter export loads in peft
ADAPTER_CONFIG_FILE = "adapter_config.json"


class AdapterConfig(TypedDict):
    """peft's ``adapter_config.json`` fields that a LoRA checkpoint records (`adapter_config`)."""

    peft_type: str
    task_type: str
    base_model_name_or_path: str
    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list[str]
    bias: str
    fan_in_fan_out: bool


def adapter_config(model: nn.Module, rank: int, alpha: float, dropout: float, base: str) -> AdapterConfig:
    """The LoRA settings a checkpoint needs to be merged or exported without the run's flags: peft's
    `adapter_config.json` fields, `target_modules` as the module names actually adapted."""
    targets = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
    }
