"""A HuggingFace checkpoint read into a model: `load_hf_model` builds it (whole on CPU, or with its parameters on
the meta device), and `CheckpointWeights` streams its weights into the FSDP2 shards `build_fsdp_model` allocates.

Sharded materialisation: every rank builds the model with its parameters on the meta device (no memory; buffers
such as rotary ``inv_freq`` are computed for real, they are small), shards it, and allocates only its own shards
on its device. Then the weights are filled one tensor at a time: rank 0 reads each tensor from the checkpoint's
safetensors files (memory-mapped, so only that tensor is read), casts it to fp32 and broadcasts it; every rank
copies its own rows into its shard. When every rank runs on rank 0's host (and can read the files), each reads
just its own rows of each tensor itself instead: the same bytes, with no broadcast. No rank ever holds more than its shards plus one full tensor (the largest: the
embedding), on the device or in host memory. A checkpoint whose tensors do not match the model by name and shape
(a layout transformers converts on load, ``.bin`` files) is loaded whole by ``from_pretrained`` on rank 0, in host
memory (never on the device), and streamed the same way. Non-persistent buffers are not part of the state dict;
they are broadcast from rank 0 separately.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from miles.utils.meta_init import parameters_on_meta

if TYPE_CHECKING:
    from safetensors import safe_open

logger = logging.getLogger(__name__)

_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"--attn-implementation={attn_implementation!r} is not supported; allowed: {_ATTN_IMPLEMENTATIONS}"
        )


def load_hf_model(
    path: str,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    on_meta: bool = False,
    flag: str = "--hf-checkpoint",
) -> nn.Module:
    """Build ``AutoModelForCausalLM`` from the HF directory ``path`` (weights on CPU, ``use_cache`` off); a
    vision-language checkpoint (its config has a ``vision_config``: Qwen2.5-VL, Qwen3-VL) builds
    ``AutoModelForImageTextToText``.

    The model is returned in train mode. ``on_meta=True`` reads only ``config.json`` and builds the model with
    its parameters on the meta device (no weights, no memory) and its buffers computed on CPU, as
    ``from_pretrained`` computes them (`parameters_on_meta`); `build_fsdp_model` builds every rank's model so.
    Tied embeddings stay tied in both cases. A missing directory, config or weights, a truncated safetensors file, or any load
    failure is a ValueError naming `flag` and the file (miles.utils.hf_files).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from miles.utils.hf_files import check_hf_dir

    _check_attn(attn_implementation)
    check_hf_dir(path, flag, need_tokenizer=False)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        is_vl = getattr(config, "vision_config", None) is not None
        auto = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
        if on_meta:
            with parameters_on_meta():
                model = auto.from_config(
                    config, attn_implementation=attn_implementation, dtype=dtype, trust_remote_code=True
                )
        else:
            model = auto.from_pretrained(
                path, attn_implementation=attn_implementation, dtype=dtype, trust_remote_code=True
            )
    except Exception as e:  # noqa: BLE001 - transformers/safetensors errors rarely name the directory
        raise ValueError(f"{flag}={path!r}: cannot load the model: {type(e).__name__}: {e}") from e
    model.config.use_cache = False  # packed forwards silently ignore packing with a KV cache
    # from_pretrained returns eval mode, from_config train mode: make every rank agree (gradient checkpointing
    # only recomputes in train mode, and the recompute issues FSDP all-gathers that all ranks must join).
    model.train()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _broadcast_buffers(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Copy every buffer (persistent or not) from rank 0; FSDP2 does not shard buffers."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for _, buf in model.named_buffers():
        dist.broadcast(buf, src=src, group=group)


class NewParameters(Protocol):
    """A module whose parameters a `build_fsdp_model` transform added (not in the checkpoint): it gives their
    initial values, full-size on CPU, by parameter name (its own parameters, not its children's)."""

    def initial_parameters(self) -> dict[str, torch.Tensor]: ...


class _TensorSource(Protocol):
    """Rank 0's full checkpoint tensors, one at a time, by their names in the checkpoint."""

    def get(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


def safetensors_shapes(path: str) -> dict[str, tuple[str, list[int]]] | None:
    """Every tensor of the HF directory `path`'s safetensors weights: name -> (file, shape), read from the files'
    headers (no tensor is read); None when the directory has no safetensors weights (``.bin`` files)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = [os.path.join(path, "model.safetensors")]
    else:
        return None
    out: dict[str, tuple[str, list[int]]] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as h:
            for name in h.keys():
                out[name] = (file, list(h.get_slice(name).get_shape()))
    return out


class _SafetensorsSource:
    """Tensors read one at a time from memory-mapped safetensors files: a read touches only that tensor's bytes."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files  # tensor name -> file
        self._open: dict[str, safe_open] = {}

    def get(self, name: str) -> torch.Tensor:
        return self._file_of(name).get_tensor(name)

    def get_rows(self, name: str, rows: tuple[slice, ...]) -> torch.Tensor:
        """Only the block ``rows`` of tensor ``name`` (one slice per dimension): only its bytes are read."""
        return self._file_of(name).get_slice(name)[rows]

    def _file_of(self, name: str) -> safe_open:
        """The open file holding tensor ``name`` (opened on first use)."""
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt", device="cpu")
        return self._open[file]

    def close(self) -> None:
        self._open.clear()


_FileId = tuple[int, int, int, int]


def _file_identity(path: str) -> _FileId | None:
    """(device, inode, size, mtime) of `path`; None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if os.access(path, os.R_OK) else None


class _LoadedModelSource:
    """The whole model as ``from_pretrained`` loads it, in host memory: for checkpoints whose tensors transformers
    converts on load (names, fused layouts) or that are not safetensors."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] | None = model.state_dict()

    def get(self, name: str) -> torch.Tensor:
        assert self.tensors is not None, "closed"
        return self.tensors[name]

    def close(self) -> None:
        self.tensors = None


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for mname, module in model.named_modules():
        for bname, buf in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def _open_checkpoint(
    path: str, wanted: dict[str, torch.Size], attn_implementation: str, flag: str
) -> _TensorSource:
    """Rank 0's source of the tensors named in `wanted` (name -> shape): the safetensors files read tensor by
    tensor when every name is there with its shape, else the whole model loaded by ``from_pretrained`` on CPU."""
    shapes = safetensors_shapes(path)
    if shapes is None:
        reason = "the weights are not safetensors"
    else:
        off = [n for n, shape in wanted.items() if n not in shapes or shapes[n][1] != list(shape)]
        reason = (
            f"{len(off)} tensor(s) differ from the model by name or shape (e.g. {off[:3]})" if off else ""
        )
    if shapes is not None and not reason:
        return _SafetensorsSource({n: shapes[n][0] for n in wanted})
    logger.info(
        "%s=%s: %s; rank 0 loads the whole model in host memory (from_pretrained) and sends it tensor by tensor",
        flag, path, reason,
    )  # fmt: skip
    return _LoadedModelSource(load_hf_model(path, attn_implementation, torch.float32, flag=flag))


def _transform_initial_values(model: nn.Module, known: set[int]) -> dict[str, torch.Tensor]:
    """The initial values of the parameters a transform added (those not in `known`, by id), in module order,
    from each owning module's `NewParameters.initial_parameters`."""
    out: dict[str, torch.Tensor] = {}
    for mname, module in model.named_modules():
        added = [n for n, p in module.named_parameters(recurse=False) if id(p) not in known]
        if not added:
            continue
        init = getattr(module, "initial_parameters", None)
        if init is None:
            raise ValueError(
                f"the model transform added parameters {added} to {mname or 'the root'} "
                f"({type(module).__name__}) without initial values: give the module an initial_parameters() method"
            )
        values = init()
        for n in added:
            out[f"{mname}.{n}" if mname else n] = values[n]
    return out


def _own_rows(param: torch.Tensor) -> tuple[slice, ...]:
    """The block of the full tensor that this rank's shard of `param` holds (all of it when not a DTensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _fill_shards(
    model: nn.Module,
    full_value: Callable[[str], torch.Tensor] | None,
    comm_device: torch.device,
    src: int,
    own_rows: Callable[[str, tuple[slice, ...]], torch.Tensor | None] | None = None,
) -> None:
    """Every parameter of the sharded `model`, in order: global rank `src` gives its full value
    (`full_value(fqn)`; None on the other ranks), it is broadcast, and each rank copies its own rows into its
    shard. Each rank holds one full tensor at a time besides its shards. With `own_rows` (every rank has it, or
    none), each rank reads its rows itself (`own_rows(fqn, rows)`) and only the parameters it answers None for
    are broadcast."""
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            if own_rows is not None:
                part = own_rows(fqn, _own_rows(param))
                if part is not None:
                    local = param.to_local() if isinstance(param, DTensor) else param
                    local.copy_(part.to(device=comm_device, dtype=param.dtype))
                    continue
            if full_value is not None:
                full = full_value(fqn).to(device=comm_device, dtype=param.dtype)
                if full.shape != param.shape:
                    raise ValueError(
                        f"{fqn}: the checkpoint has shape {list(full.shape)}, the model {list(param.shape)}"
                    )
            else:
                full = torch.empty(param.shape, dtype=param.dtype, device=comm_device)
            dist.broadcast(full, src=src)
            if isinstance(param, DTensor):
                param.to_local().copy_(full[_own_rows(param)])
            else:
                param.copy_(full)
            del full


class CheckpointWeights:
    """Where each parameter and buffer of a model built on the meta device (`load_hf_model(on_meta=True)`) gets
    its value, and the streaming of those values into the model once it is sharded. Collective: every rank builds
    one (only global rank 0, `is_src`, opens the checkpoint) and calls its methods in order.

    Built before a transform edits the module tree (a value head, LoRA adapters): the checkpoint names are recorded
    by parameter identity, since a transform keeps a parameter under another name (LoRA's base weights) or adds new
    ones. `after_transform` maps every parameter to its checkpoint name, or to its initial value when the transform
    added it (`NewParameters`), and copies the buffers (allocating the shards drops their values); `fill` writes
    everything into the sharded model."""

    def __init__(
        self, model: nn.Module, path: str, attn_implementation: str, flag: str, is_src: bool
    ) -> None:
        self.path, self.flag, self.is_src = path, flag, is_src
        # kept until after_transform, so that no new parameter takes a replaced one's id
        self._before = list(model.named_parameters())
        self._checkpoint_name = {id(p): n for n, p in self._before}
        self._persistent = _persistent_buffers(model)
        self._source: _TensorSource | None = None
        if is_src:
            wanted = {n: p.shape for n, p in model.named_parameters()}
            wanted.update({n: b.shape for n, b in self._persistent.items()})
            self._source = _open_checkpoint(path, wanted, attn_implementation, flag)
        self._local = self._agree_local_reads()
        self._names: dict[
            str, str | None
        ] = {}  # parameter -> its checkpoint name (None: added by the transform)
        self._initial: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    def _agree_local_reads(self) -> _SafetensorsSource | None:
        """The checkpoint's safetensors files when every rank runs on global rank 0's host and finds there the
        very files rank 0 opened (same absolute path, device, inode, size and mtime): each rank then reads its own
        rows of every checkpoint tensor itself (the same bytes, nothing broadcast, no rank waits for another's
        reads). None: rank 0 reads and broadcasts each tensor (other hosts, a checkpoint loaded by
        ``from_pretrained``). Collective."""
        mine = self._source if isinstance(self._source, _SafetensorsSource) else None
        if dist.get_world_size() == 1:
            return mine
        files = {n: os.path.abspath(f) for n, f in mine.files.items()} if mine is not None else None
        ids = {f: _file_identity(f) for f in set(files.values())} if files is not None else None
        offer: list[tuple[str, dict[str, str] | None, dict[str, _FileId | None] | None] | None] = [
            (socket.gethostname(), files, ids)
        ]
        dist.broadcast_object_list(offer, src=0)
        assert offer[0] is not None
        host, files, ids = offer[0]
        same = ids is not None and None not in ids.values() and host == socket.gethostname()
        if same and ids is not None:
            same = all(_file_identity(f) == i for f, i in ids.items())
        votes: list[bool | None] = [None] * dist.get_world_size()
        dist.all_gather_object(votes, same)
        if files is None or not all(votes):
            return None
        return mine if mine is not None else _SafetensorsSource(files)

    def after_transform(self, model: nn.Module) -> None:
        """Record the module tree as the transform left it (call before sharding)."""
        self._names = {fqn: self._checkpoint_name.get(id(p)) for fqn, p in model.named_parameters()}
        self._initial = _transform_initial_values(model, set(self._checkpoint_name)) if self.is_src else {}
        self._before = []
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # to_empty drops their values
        if self._source is not None:
            for n in _persistent_buffers(model).keys() & self._persistent.keys():
                buffers[n] = self._source.get(n).to(buffers[n].dtype)
        self._buffers = buffers

    def fill(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """Write the buffers and every parameter's shard into `model`, sharded over `mesh` and allocated
        (``to_empty``); closes the checkpoint."""
        with torch.no_grad():
            for n, value in self._buffers.items():
                model.get_buffer(n).copy_(value)
        self._buffers = {}
        comm_device = (
            torch.device(mesh.device_type, torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else torch.device(mesh.device_type)
        )
        own_rows = self._own_rows if self._local is not None else None
        try:
            _fill_shards(model, self._full_value if self.is_src else None, comm_device, 0, own_rows)
        finally:
            for source in (self._source, self._local):
                if source is not None:
                    source.close()
        _broadcast_buffers(model, mesh.get_group())

    def _own_rows(self, fqn: str, rows: tuple[slice, ...]) -> torch.Tensor | None:
        """This rank's block of parameter `fqn` read from the checkpoint; None when a transform added it."""
        ckpt = self._names[fqn]
        if ckpt is None:
            return None
        assert self._local is not None
        try:
            return self._local.get_rows(ckpt, rows)
        except Exception as e:  # noqa: BLE001 - safetensors errors do not name the directory
            raise ValueError(f"{self.flag}={self.path!r}: cannot read {ckpt}: {type(e).__name__}: {e}") from e

    def _full_value(self, fqn: str) -> torch.Tensor:
        ckpt = self._names[fqn]
        if ckpt is None:
            return self._initial[fqn]
        assert self._source is not None
        try:
            return self._source.get(ckpt)
        except Exception as e:  # noqa: BLE001 - safetensors errors do not name the directory
            raise ValueError(f"{self.flag}={self.path!r}: cannot read {ckpt}: {type(e).__name__}: {e}") from e
