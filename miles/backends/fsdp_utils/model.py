"""The FSDP2 model of a role: a HuggingFace causal LM built sharded (`build_fsdp_model`: on the meta device, sharded
by `apply_fsdp2`, its weights streamed from rank 0 by hf_load.py), the frozen reference model, the critic's value
head, the optimizer, and the gradient sync and clipping of a sharded step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

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

from miles.backends.fsdp_utils.hf_load import CheckpointWeights, load_hf_model

_OPTIMIZERS = ("adam", "sgd")
_FUSED_ADAM_DEVICES = ("cpu", "cuda")
_FSDP_MODULES = "_miles_fsdp_modules"  # on a wrapped model: its FSDP modules, for `sync_gradients_after`


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (``model.model.layers``; a Qwen-VL model's ``model.model.language_model.layers``)
    that FSDP2 shards one by one."""
    try:
        inner = model.model
        layers = inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
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
    inner_units: Sequence[tuple[nn.Module, DeviceMesh]] = (),
) -> nn.Module:
    """Shard every decoder layer, then the root, over the 1-D ``mesh`` (``per_layer=False``: the root only, one
    unit for the whole model, see `per_layer_units`); returns the (same) model. A vision-language model's vision
    tower is sharded first: every vision block, then the tower (patch embedding, merger) as a unit of its own,
    whatever ``per_layer`` (so freezing it, --freeze-vision-tower, leaves whole units without gradients).

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
    for unit in _vision_units(model):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    for unit, unit_mesh in inner_units:  # expert parallelism: each layer's experts over their own mesh
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **{**kwargs, "mesh": unit_mesh})
    for layer in decoder_layers(model) if per_layer else ():
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def _vision_units(model: nn.Module) -> list[nn.Module]:
    """A Qwen-VL model's FSDP units of its vision tower: each block, then the tower; [] for a text model."""
    from miles.backends.fsdp_utils.vl_packing import is_vl_model, vision_tower

    if not is_vl_model(model):
        return []
    tower = vision_tower(model)
    return [*getattr(tower, "blocks", []), tower]


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
    tp_mesh: DeviceMesh | None = None,
    ep_size: int = 1,
) -> nn.Module:
    """Build ``path`` sharded with `apply_fsdp2`: every rank builds it with its parameters on the meta device,
    shards it, allocates its own shards and receives the weights tensor by tensor from global rank 0
    (`CheckpointWeights`, see hf_load.py); no rank materialises the full model.

    The master weights are fp32 (``param_dtype`` is the compute dtype). ``device`` is where the shards live
    (CPU when ``cpu_offload``). ``transform`` edits the module tree on every rank before sharding (a value
    head, LoRA adapters); the parameters it creates are not in the checkpoint: rank 0 takes their initial values
    from their modules (`hf_load.NewParameters`). Collective: every rank of ``mesh`` must call it.

    ``reshard_after_forward`` (None: `default_reshard_after_forward` of ``device``) frees each layer's gathered
    parameters after its forward, so the backward gathers them again.

    ``tp_mesh`` (tensor parallelism, `tensor_parallel.apply_tensor_parallel`): the decoder layers' projections are
    split over it before FSDP2 shards over ``mesh`` (the data-parallel ranks); ``mesh`` x ``tp_mesh`` then covers
    every rank.

    ``ep_size`` (expert parallelism, `expert_parallel.apply_expert_parallel`): each MoE layer's experts are split
    over groups of ``ep_size`` ranks and sharded by FSDP2 over the ranks holding the same experts.
    """
    tp_size = 1 if tp_mesh is None else tp_mesh.size()
    if mesh.ndim != 1 or mesh.size() * tp_size != dist.get_world_size():
        # the weights are broadcast from global rank 0 over the default group
        raise ValueError(
            f"build_fsdp_model needs a 1-D mesh over all {dist.get_world_size()} ranks (with the tensor-parallel "
            f"mesh: over all / tp), got {mesh} (tp {tp_size})"
        )
    if reshard_after_forward is None:
        reshard_after_forward = default_reshard_after_forward(device)
    model = load_hf_model(
        path, attn_implementation, torch.float32, gradient_checkpointing, on_meta=True, flag=flag
    )
    weights = CheckpointWeights(model, path, attn_implementation, flag, is_src=dist.get_rank() == 0)
    if transform is not None:
        transform(model)
    weights.after_transform(model)
    if tp_mesh is not None:
        from miles.backends.fsdp_utils.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh)
    inner_units: list[tuple[nn.Module, DeviceMesh]] = []
    if ep_size > 1:
        from miles.backends.fsdp_utils.expert_parallel import apply_expert_parallel, expert_meshes

        ep_mesh, edp_mesh = expert_meshes(mesh.device_type, ep_size)
        inner_units = [(unit, edp_mesh) for unit in apply_expert_parallel(model, ep_mesh)]
    shard_device = torch.device("cpu") if cpu_offload else torch.device(device)
    per_layer = per_layer_units(device, cpu_offload, reshard_after_forward)
    apply_fsdp2(
        model, mesh, param_dtype, reduce_dtype, cpu_offload, reshard_after_forward, per_layer, inner_units
    )
    model.to_empty(device=shard_device)
    weights.fill(model, mesh)
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
    # what `set_requires_gradient_sync` / `set_reshard_after_backward` do with recurse, without walking every
    # module of the model twice per micro-batch: its FSDP modules are listed once (the wrap does not change)
    fsdp_modules = model.__dict__.get(_FSDP_MODULES)
    if fsdp_modules is None:
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        model.__dict__[_FSDP_MODULES] = fsdp_modules
    for module in fsdp_modules:
        module.set_requires_gradient_sync(last_micro_batch, recurse=False)
        module.set_reshard_after_backward(last_micro_batch, recurse=False)


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
        if all(_without_partial(g) for g in grads):  # tensor parallelism: (dp, tp) and dp-only shards
            return _clip_multi_mesh(grads, max_norm)
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


def _without_partial(grad: torch.Tensor) -> bool:
    return isinstance(grad, DTensor) and not any(p.is_partial() for p in grad.placements)


def _copies(grad: DTensor) -> int:
    """On how many ranks of the world each element of ``grad`` lives: the ranks outside its mesh, times the
    sizes of the mesh dimensions it is replicated on."""
    mesh, copies = grad.device_mesh, dist.get_world_size() // grad.device_mesh.size()
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def _clip_multi_mesh(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_sharded` for DTensors on meshes of different sizes (tensor parallelism: a projection
    sharded on the (dp, tp) mesh, a per-head norm replicated on tp, an embedding on the dp mesh and so copied on
    every TP rank): every local squared norm is divided by its number of copies (`_copies`), the sums are
    all-reduced over all ranks (each element counted once in all), the clip as there."""
    local = [g.to_local() for g in grads]
    weights = torch.tensor([1.0 / _copies(g) for g in grads], dtype=torch.float32)
    squares = torch.stack(torch._foreach_norm(local, 2.0)).float() ** 2
    total = (squares * weights.to(squares.device)).sum()
    dist.all_reduce(total)
    total = total ** (1.0 / 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(local, coef.to(local[0].dtype))
    return total


def build_reference_model(
    path: str,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    flag: str = "--ref-load (or --hf-checkpoint)",
    tp_mesh: DeviceMesh | None = None,
    ep_size: int = 1,
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
        tp_mesh=tp_mesh,
        ep_size=ep_size,
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
    """The critic's head, ``Linear(hidden, 1)``; it starts at zero (`hf_load.NewParameters`)."""

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
