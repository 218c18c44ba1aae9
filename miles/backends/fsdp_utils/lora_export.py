"""HF export of a LoRA checkpoint (a `--save` of a `--lora-rank` run), in one process on CPU.

A LoRA checkpoint holds the adapters (``model.<module>.lora_A`` [r, in], ``.lora_B`` [out, r]) and their optimizer
state, not the frozen base weights; ``iter_N/adapter_config.json`` (written at save) names the base model
directory and the LoRA settings, with peft's field names (``r``, ``lora_alpha``, ``target_modules`` ...).

- ``merged``: a plain HF model directory (the layout of `hf_export.convert_checkpoint`), every adapted weight
  ``W + lora_alpha / r * B @ A`` computed by `lora.merge` (the refit's formula, so the tensors equal what the
  trainer's refit sends), the other tensors copied from the base. One base tensor in memory at a time.
- ``adapter``: the adapter alone as peft writes one: ``adapter_model.safetensors`` with the tensors named
  ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` and ``adapter_config.json``.
  `read_adapter` reads it back.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from miles.backends.fsdp_utils import hf_export
from miles.backends.fsdp_utils.lora import ADAPTER_CONFIG_FILE, AdapterConfig, adapter_config, merge
from miles.config.sections import LoraConfig
from miles.utils.types import JSON

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_EXPORTS = ("merged", "adapter")
_PEFT_PREFIX = "base_model.model."


def write_adapter_config(
    ckpt_dir: str | os.PathLike[str], model: nn.Module, lora: LoraConfig, base: str
) -> Path:
    """Write `adapter_config.json` into checkpoint `ckpt_dir` (temp file + rename). Call on one rank."""
    base_path = os.path.abspath(base) if os.path.isdir(base) else base
    config = adapter_config(model, lora.lora_rank, lora.lora_alpha, lora.lora_dropout, base_path)
    final = Path(ckpt_dir) / ADAPTER_CONFIG_FILE
    tmp = final.with_name(final.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, final)
    return final


def is_lora_checkpoint(iter_dir: Path) -> bool:
    """Whether DCP checkpoint `iter_dir` holds LoRA adapters (and no base weights)."""
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    return any(k.startswith("model.") and k.endswith(".lora_A") for k in stored)


def _read_config(iter_dir: Path) -> AdapterConfig:
    path = iter_dir / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"{iter_dir} holds LoRA adapters but no {ADAPTER_CONFIG_FILE} (checkpoints from before LoRA export): "
            "its lora_alpha is unknown, so it cannot be merged"
        )
    return json.loads(path.read_text())


def _load_adapters(iter_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A, B)} of the checkpoint, in float32 as trained."""
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    names = [k for k in stored if k.startswith("model.") and k.endswith((".lora_A", ".lora_B"))]
    state = {
        "model": {
            k[len("model.") :]: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype)
            for k in names
        }
    }
    dcp.load(state, checkpoint_id=str(iter_dir), no_dist=True)
    tensors = state["model"]
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors})
    return {m: (tensors[f"{m}.lora_A"], tensors[f"{m}.lora_B"]) for m in modules}


class _BaseWeights:
    """Reads the tensors of a HF safetensors directory one by one (by name, through its index if sharded)."""

    def __init__(self, path: Path) -> None:
        index = path / hf_export.INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: path / f for name, f in weight_map.items()}
        elif (path / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(path / "model.safetensors"), "pt") as f:
                self.files = dict.fromkeys(f.keys(), path / "model.safetensors")
        else:
            raise ValueError(f"{path}: the LoRA base model must be a HF directory of safetensors weights")
        self.path = path

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"{self.path}: the base model has no tensor {name!r}")
        with safe_open(str(self.files[name]), "pt") as f:
            return f.get_tensor(name)


def convert_lora_checkpoint(
    iter_dir: Path,
    out_dir: str | os.PathLike[str],
    export: str,
    dtype: torch.dtype | None = None,
    base: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Export LoRA checkpoint `iter_dir` as `export` ("merged" or "adapter", see the module doc) into `out_dir`.
    `base`: the base model directory, instead of the one in the checkpoint's adapter_config.json. `dtype` None:
    the training dtype (the checkpoint's hf/config.json)."""
    if export not in LORA_EXPORTS:
        raise ValueError(f"--lora-export={export!r}: choose one of {LORA_EXPORTS}")
    config = _read_config(iter_dir)
    source = iter_dir / hf_export.CKPT_HF_DIR
    if not (source / "config.json").is_file():
        raise ValueError(f"{iter_dir}: no {hf_export.CKPT_HF_DIR}/config.json beside the adapters")
    final = Path(out_dir)
    if final.exists() and any(final.iterdir()) and not overwrite:
        raise ValueError(f"--out={str(out_dir)!r} exists and is not empty; pass --overwrite to replace it")
    out_dtype = dtype if dtype is not None else hf_export.source_dtype(source)
    adapters = _load_adapters(iter_dir)
    if export == "adapter":
        return _write_adapter(adapters, config, final, out_dtype)
    base_dir = Path(base if base is not None else config["base_model_name_or_path"])
    if not (base_dir / "config.json").is_file():
        raise ValueError(
            f"LoRA base model {str(base_dir)!r} (from {iter_dir / ADAPTER_CONFIG_FILE}) is not a HF directory; "
            "pass --hf-checkpoint DIR, the model the run started from"
        )
    return _write_merged(adapters, config, _BaseWeights(base_dir), source, final, out_dtype, max_shard_bytes)


def _write_merged(
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
    config: AdapterConfig,
    base: _BaseWeights,
    source: Path,
    final: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> Path:
    from transformers import AutoConfig

    scaling = float(config["lora_alpha"]) / int(config["r"])
    tensors = hf_export.export_tensor_names(AutoConfig.from_pretrained(source, trust_remote_code=True))
    unmatched = set(adapters) - {t.name.removesuffix(".weight") for t in tensors}
    if unmatched:
        raise ValueError(f"adapters for modules the model config does not have: {sorted(unmatched)[:5]}")
    writer = hf_export.ShardWriter(hf_export.fresh_tmp(final), max_shard_bytes)
    for t in tensors:
        # the trainer holds the base in float32 and merges there: do the same, then cast
        value = base.get(t.name).float()
        module = t.name.removesuffix(".weight")
        if module in adapters:
            a, b = adapters[module]
            value = merge(value, a, b, scaling)
        writer.add(t.name, value.to(dtype) if value.is_floating_point() else value)
    num_shards = writer.finish()
    hf_export.copy_metadata(source, writer.out, dtype)
    hf_export.commit_dir(writer.out, final)
    logger.info("merged %d LoRA adapters into %s (%d shards)", len(adapters), final, num_shards)
    return final


def _write_adapter(
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
    config: AdapterConfig,
    final: Path,
    dtype: torch.dtype,
) -> Path:
    from safetensors.torch import save_file

    tmp = hf_export.fresh_tmp(final)
    tensors = {}
    for module, (a, b) in adapters.items():
        tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.to(dtype).contiguous()
        tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b.to(dtype).contiguous()
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    hf_export.commit_dir(tmp, final)
    logger.info("wrote %d LoRA adapters to %s", len(adapters), final)
    return final


def read_adapter(
    path: str | os.PathLike[str],
) -> tuple[dict[str, JSON], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """An adapter export (or peft adapter directory) read back: (adapter_config, {module name: (A, B)})."""
    from safetensors.torch import load_file

    p = Path(path)
    config = json.loads((p / ADAPTER_CONFIG_FILE).read_text())
    tensors = load_file(str(p / ADAPTER_WEIGHTS_FILE))
    modules = sorted({k[len(_PEFT_PREFIX) :].rsplit(".", 2)[0] for k in tensors})
    return config, {
        m: (tensors[f"{_PEFT_PREFIX}{m}.lora_A.weight"], tensors[f"{_PEFT_PREFIX}{m}.lora_B.weight"])
        for m in modules
    }
