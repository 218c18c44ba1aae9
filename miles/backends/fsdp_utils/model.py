"""Load a HuggingFace causal LM, shard it with FSDP2, build the reference model and the optimizer.

Sharded materialisation (`build_fsdp_model`): every rank builds the model with its parameters on the meta device
(no memory; buffers such as rotary ``inv_freq`` are computed for real, they are small), shards it, and allocates
only its own shards on its device. Then the weights are filled one tensor at a time: rank 0 reads each tensor
from the checkpoint's safetensors files (memory-mapped, so only that tensor is read), casts it to fp32 and
broadcasts it; every rank copies its own rows into its shard. No rank ever holds more than its shards plus one
full tensor (the largest: the embedding), on the device or in host memory. A checkpoint whose tensors do not
match the model by name and shape (a layout transformers converts on load, ``.bin`` files) is loaded whole by
``from_pretrained`` on rank 0, in host memory (never on the device), and streamed the same way. Non-persistent
buffers are not part of the state dict; they are broadcast from rank 0 separately.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

logger = logging.getLogger(__name__)

_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
_OPTIMIZERS = ("adam", "sgd")
_FUSED_ADAM_DEVICES = ("cpu", "cuda")


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"--attn-implementation={attn_implementation!r} is not supported; allowed: {_ATTN_IMPLEMENTATIONS}"
        )


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, every parameter a module registers goes to the meta device as it is registered (its
    initialisation then runs on meta: no memory, no time), while buffers stay real: a model built here has
    the non-persistent buffers it computes in its constructor (rotary ``inv_freq``) and no weights. Each
    parameter is allocated (uninitialised) for the instant of its registration only."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def load_hf_model(
    path: str,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    on_meta: bool = False,
    flag: str = "--hf-checkpoint",
) -> nn.Module:
    """Build ``AutoModelForCausalLM`` from the HF directory ``path`` (weights on CPU, ``use_cache`` off).

    The model is returned in train mode. ``on_meta=True`` reads only ``config.json`` and builds the model with
    its parameters on the meta device (no weights, no memory) and its buffers computed on CPU, as
    ``from_pretrained`` computes them (`parameters_on_meta`); `build_fsdp_model` builds every rank's model so.
    Tied embeddings stay tied in both cases. A missing directory, config or weights, a truncated safetensors file, or any load
    failure is a ValueError naming `flag` and the file (miles.utils.hf_files).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.utils.hf_files import check_hf_dir

    _check_attn(attn_implementation)
    check_hf_dir(path, flag, need_tokenizer=False)
    try:
        if on_meta:
            config = AutoConfig.from_pretrained(path, trust_remote_code=True)
            with parameters_on_meta():
                model = AutoModelForCausalLM.from_config(
                    config, attn_implementation=attn_implementation, dtype=dtype, trust_remote_code=True
                )
        else:
            model = AutoModelForCausalLM.from_pretrained(
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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (``model.model.layers``) that FSDP2 shards one by one."""
    try:
        layers = model.model.layers
    except AttributeError as e:
        raise ValueError(
            f"{type(model).__name__} has no `model.layers`; apply_fsdp2 supports decoder-only HF causal LMs"
        ) from e
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}.model.layers is a {type(layers).__name__}, not an nn.ModuleList"
        )
    return layers


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    reshard_after_forward: bool = True,
    per_layer: bool = True,
) -> nn.Module:
    """Shard every decoder layer, then the root, over the 1-D ``mesh`` (``per_layer=False``: the root only, one
    unit for the whole model, see `per_layer_units`); returns the (same) model.

    Gradients are *averaged* over the mesh ranks by FSDP's reduce-scatter: a loss that is a sum over the global
    batch must be scaled by the mesh size on each rank. ``cpu_offload`` keeps parameters, gradients and the
    optimizer step on CPU (CPUOffloadPolicy).
    """
    if mesh.ndim != 1:
        raise ValueError(
            f"apply_fsdp2 expects a 1-D mesh (ParallelState.fsdp_mesh), got {mesh.ndim}-D {mesh}"
        )
    # computing in the weights' own dtype needs no cast: without a param_dtype FSDP does not walk every layer's
    # forward arguments to cast them (the same numbers, less Python per layer call)
    same_dtype = all(p.dtype == param_dtype for p in model.parameters())
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if same_dtype else param_dtype, reduce_dtype=reduce_dtype
    )
    # pinned host memory needs an accelerator; a CPU-only run keeps ordinary pages
    pin = torch.cuda.is_available()
    offload_policy: OffloadPolicy = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for layer in decoder_layers(model) if per_layer else ():
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
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
        self._open: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt", device="cpu")
        return self._open[file].get_tensor(name)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._open.clear()


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
    out = {}
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


def _fill_shards(
    model: nn.Module, full_value: Callable[[str], torch.Tensor] | None, comm_device: torch.device, src: int
) -> None:
    """Every parameter of the sharded `model`, in order: global rank `src` gives its full value
    (`full_value(fqn)`; None on the other ranks), it is broadcast, and each rank copies its own rows into its
    shard. Each rank holds one full tensor at a time besides its shards."""
    with torch.no_grad():
        for fqn, param in model.named_parameters():
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
                shape, offset = compute_local_shape_and_global_offset(
                    param.shape, param.device_mesh, param.placements
                )
                rows = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                param.to_local().copy_(full[rows])
            else:
                param.copy_(full)
            del full


def build_fsdp_model(
    path: str,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    device: torch.device | str = "cpu",
    reshard_after_forward: bool | None = None,
    flag: str = "--hf-checkpoint",
    transform: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Build ``path`` sharded with `apply_fsdp2`: every rank builds it with its parameters on the meta device,
    shards it, allocates its own shards and receives the weights tensor by tensor from global rank 0 (see the
    module docstring); no rank materialises the full model.

    The master weights are fp32 (``param_dtype`` is the compute dtype). ``device`` is where the shards live
    (CPU when ``cpu_offload``). ``transform`` edits the module tree on every rank before sharding (a value
    head, LoRA adapters); the parameters it creates are not in the checkpoint: rank 0 takes their initial values
    from their modules (`NewParameters`). Collective: every rank of ``mesh`` must call it.

    ``reshard_after_forward`` (None: `default_reshard_after_forward` of ``device``) frees each layer's gathered
    parameters after its forward, so the backward gathers them again.
    """
    if mesh.ndim != 1 or mesh.size() != dist.get_world_size():
        # the weights are broadcast from global rank 0 over the default group
        raise ValueError(
            f"build_fsdp_model needs a 1-D mesh over all {dist.get_world_size()} ranks, got {mesh}"
        )
    if reshard_after_forward is None:
        reshard_after_forward = default_reshard_after_forward(device)
    is_src = dist.get_rank() == 0
    model = load_hf_model(
        path, attn_implementation, torch.float32, gradient_checkpointing, on_meta=True, flag=flag
    )
    # by identity: a transform keeps a parameter under another name (LoRA's base weights) or adds new ones; the
    # list keeps the replaced ones alive, so that no new parameter takes a replaced one's id
    before = list(model.named_parameters())
    checkpoint_name = {id(p): n for n, p in before}
    persistent = _persistent_buffers(model)
    source: _TensorSource | None = None
    if is_src:
        wanted = {n: p.shape for n, p in model.named_parameters()}
        wanted.update({n: b.shape for n, b in persistent.items()})
        source = _open_checkpoint(path, wanted, attn_implementation, flag)
    if transform is not None:
        transform(model)
    names = {fqn: checkpoint_name.get(id(p)) for fqn, p in model.named_parameters()}
    initial = _transform_initial_values(model, set(checkpoint_name)) if is_src else {}
    del before
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # to_empty below drops their values
    if source is not None:
        for n in _persistent_buffers(model).keys() & persistent.keys():
            buffers[n] = source.get(n).to(buffers[n].dtype)
    shard_device = torch.device("cpu") if cpu_offload else torch.device(device)
    per_layer = per_layer_units(device, cpu_offload, reshard_after_forward)
    apply_fsdp2(model, mesh, param_dtype, reduce_dtype, cpu_offload, reshard_after_forward, per_layer)
    model.to_empty(device=shard_device)
    with torch.no_grad():
        for n, value in buffers.items():
            model.get_buffer(n).copy_(value)
    del buffers

    def full_value(fqn: str) -> torch.Tensor:
        ckpt = names[fqn]
        if ckpt is None:
            return initial[fqn]
        assert source is not None
        try:
            return source.get(ckpt)
        except Exception as e:  # noqa: BLE001 - safetensors errors do not name the directory
            raise ValueError(f"{flag}={path!r}: cannot read {ckpt}: {type(e).__name__}: {e}") from e

    comm_device = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device(mesh.device_type)
    )
    try:
        _fill_shards(model, full_value if is_src else None, comm_device, src=0)
    finally:
        if source is not None:
            source.close()
    _broadcast_buffers(model, mesh.get_group())
    return model


def default_reshard_after_forward(device: torch.device | str) -> bool:
    """Whether a trained model frees its gathered layers after the forward: on an accelerator yes (device memory
    is what sharding saves); on CPU no: the ranks share the host's memory, the gathered copy of a layer is
    as large as the activations kept for its backward, and keeping it until the backward saves every layer's
    second all-gather (measured: ~0.4 s of a 15 s step of a 25M model on 2 gloo ranks, scripts/bench/train_step.py).
    The backward frees it either way; the numbers are the same (an all-gather is a copy)."""
    return torch.device(device).type != "cpu"


def per_layer_units(device: torch.device | str, cpu_offload: bool, reshard_after_forward: bool) -> bool:
    """Whether `apply_fsdp2` makes every decoder layer an FSDP unit of its own, or only the root. Per-layer
    units free a layer's gathered parameters after its forward (``reshard_after_forward``), let an accelerator
    overlap one layer's collectives with the next layer's compute, and with --fsdp-cpu-offload move one layer at
    a time to the compute device. Computing on CPU without either there is none of that to gain: gloo's
    collectives block (nothing overlaps), every layer stays gathered from its forward to the end of the backward,
    so one unit holds the same memory at the peak, while each extra unit costs an all-gather, a reduce-scatter
    and FSDP's Python hooks around every forward and backward (`scripts/bench/train_step.py --workload
    quickstart`, 2 ranks: 0.052 -> 0.046 s per step). One unit keeps the whole unsharded gradient until the
    backward ends, which the deferred sync of several micro-batches (`default_defer_gradient_sync`) does anyway.
    The numbers are the same: parameters are sharded one by one either way, and an all-gather is a copy."""
    return reshard_after_forward or cpu_offload or torch.device(device).type != "cpu"


def default_defer_gradient_sync(device: torch.device | str, cpu_offload: bool) -> bool:
    """Whether an optimizer step's micro-batches reduce-scatter their gradients once, after the last backward,
    instead of once per micro-batch (`sync_gradients_after`). On CPU without --fsdp-cpu-offload yes: the ranks
    share the host's memory and cores, each rank's unsharded gradient is the size of the model, and the deferred
    step saves every layer's reduce-scatter and all-gather of all but one micro-batch (gloo collectives are most
    of a small model's step). On an accelerator no: device memory is what sharding saves.

    The numbers move by rounding only: each rank sums its micro-batches' gradients before the cross-rank average
    instead of after it."""
    return torch.device(device).type == "cpu" and not cpu_offload


def sync_gradients_after(model: nn.Module, last_micro_batch: bool, defer: bool) -> None:
    """Call before each micro-batch's forward. With `defer` (`default_defer_gradient_sync`), only the step's last
    micro-batch reduce-scatters: the others accumulate unsharded gradients on their rank and keep the gathered
    parameters for the next micro-batch (no all-gather in its forward). Without `defer`, or for a model that is
    not FSDP-wrapped, nothing changes."""
    if not defer or not isinstance(model, FSDPModule):
        return
    model.set_requires_gradient_sync(last_micro_batch)
    model.set_reshard_after_backward(last_micro_batch)


def clip_grad_norm_sharded(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (2-norm) over FSDP2-sharded gradients with ONE all-reduce: each rank
    takes the norm of its local shards (`_foreach_norm`, then the norm of those), the squares are summed over
    the shards' mesh and the root is the global norm, which scales every local shard by
    min(1, max_norm / (norm + 1e-6)). This is what the DTensor path computes (its partial-norm reduction raises
    to the power 2, sums, takes the root) without DTensor dispatch per operation. Returns the norm before
    clipping (a 0-d tensor, the same on every rank; non-finite when a gradient is).

    Gradients that are not all sharded over one mesh (a plain module, replicated DTensors) go through
    `clip_grad_norm_` itself."""
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad]
    if not grads:
        return torch.zeros(())
    mesh = grads[0].device_mesh if isinstance(grads[0], DTensor) else None
    if mesh is None or mesh.ndim != 1 or not all(_sharded_on(g, mesh) for g in grads):
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    local = [g.to_local() for g in grads]
    local_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local, 2.0)), 2.0)
    total = local_norm**2
    dist.all_reduce(total, group=mesh.get_group())
    total = total ** (1.0 / 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(local, coef)
    return total


def _sharded_on(grad: torch.Tensor, mesh: DeviceMesh) -> bool:
    return (
        isinstance(grad, DTensor) and grad.device_mesh == mesh and all(p.is_shard() for p in grad.placements)
    )


def build_reference_model(
    path: str,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    flag: str = "--ref-load (or --hf-checkpoint)",
) -> nn.Module:
    """A frozen FSDP2 copy of ``path`` for reference log-probs: CPUOffloadPolicy, eval mode, no grads.

    Its parameters live on CPU and are copied to the compute device layer by layer during the forward.
    """
    model = build_fsdp_model(
        path,
        mesh,
        param_dtype,
        reduce_dtype,
        cpu_offload=True,
        attn_implementation=attn_implementation,
        reshard_after_forward=True,  # no backward: a gathered layer would stay gathered
        flag=flag,
    )
    model.eval()
    model.requires_grad_(False)
    return model


def build_optimizer(
    params: Iterable[nn.Parameter],
    name: str = "adam",
    lr: float = 1e-6,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """``adam`` -> AdamW (decoupled weight decay), ``sgd`` -> SGD (no momentum). Only trainable params.

    AdamW runs its fused kernel (one pass over each parameter's state instead of one per operation; what HF's
    Trainer and TRL use by default): the same update up to rounding (~1 ulp), ~3x faster on CPU."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: no parameters require grad")
    if lr < 0:
        raise ValueError(f"--lr={lr}: must be >= 0")
    if name == "adam":
        fused = all(p.device.type in _FUSED_ADAM_DEVICES for p in params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"--optimizer={name!r} is not supported; allowed: {_OPTIMIZERS}")


class ValueHead(nn.Linear):
    """The critic's head, ``Linear(hidden, 1)``; it starts at zero (`NewParameters`)."""

    def __init__(self, hidden: int, device: torch.device | str | None = None) -> None:
        super().__init__(hidden, 1, bias=True, device=device, dtype=torch.float32)

    def initial_parameters(self) -> dict[str, torch.Tensor]:
        return {"weight": torch.zeros(1, self.in_features), "bias": torch.zeros(1)}


def attach_value_head(model: nn.Module) -> None:
    """Turn a causal LM into a critic: the LM head becomes ``Linear(hidden, 1)`` (zero-initialised, so every
    value starts at 0), untied from the input embeddings. The model's "logits" are then values [.., 1]."""
    hidden = model.get_input_embeddings().weight.shape[1]
    device = model.get_input_embeddings().weight.device
    model.config.tie_word_embeddings = False
    head = ValueHead(hidden, device=device)
    if device.type != "meta":
        with torch.no_grad():
            for name, value in head.initial_parameters().items():
                head.get_parameter(name).copy_(value)
    model.set_output_embeddings(head)
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = {} if isinstance(model._tied_weights_keys, dict) else []
