"""One FSDP2 training state, whatever the role: the policy (`actor.FSDPTrainer`) and the critic
(`critic.FSDPCritic`) each compose one, built from a `StateSpec`.

`FSDPState` owns what every trained model needs: the process group and (dp, cp) mesh, the sharded model (built from
a HF directory, with an optional transform: LoRA adapters, a value head), its optimizer and LR schedule, the
checkpoint it saves and resumes (model, optimizer, schedule, RNG, the driver's extra state), offloading between
train calls (sleep / wake_up) and the clipped optimizer step. What a role computes with the model (log-probs,
values, losses, the refit) stays in the role.

The module also holds the helpers every role shares: the parameter dtype, CPU threads, the attention kernel and
the fused elementwise ops.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed.device_mesh import DeviceMesh

    from miles.backends.fsdp_utils.context_parallel import CPContext
    from miles.backends.fsdp_utils.lr_scheduler import LRScheduler
    from miles.backends.fsdp_utils.parallel import ParallelState
    from miles.backends.fsdp_utils.rollout_batch import RankBatch
    from miles.config import Config
    from miles.utils.types import JSON

logger = logging.getLogger(__name__)
CPU_TRAIN_THREADS_ENV = "MILES_CPU_TRAIN_THREADS"  # set by miles.ray.setup for --fully-async on CPU


@dataclass(frozen=True)
class StateSpec:
    """What differs between the roles' training states; everything else comes from the config."""

    role: str  # "actor", "critic": names the state in logs and warnings
    init_path: str  # the HF directory the architecture (and, without `init_dcp`, the weights) come from
    init_flag: str  # the flag that named `init_path`, for errors
    transform: (
        Callable[[torch.nn.Module], None] | None
    )  # None: the plain LM; else LoRA adapters, a value head
    lr: float
    min_lr: float
    warmup_iters: int = 0
    warmup_fraction: float | None = None
    checkpoint_subdir: str = ""  # under --save and --load: "" (the policy), "critic"
    init_dcp: Path | None = None  # a DCP checkpoint whose weights are loaded over the built model


class ModelKwargs(TypedDict):
    """How every model of a rank is built (`build_fsdp_model`, `build_reference_model`)."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    attn_implementation: str
    tp_mesh: DeviceMesh | None  # tensor parallelism (--tensor-model-parallel-size > 1), else None
    ep_size: int  # expert parallelism (--expert-model-parallel-size)


class FSDPState:
    """The sharded model with its optimizer, LR schedule, checkpoint and offload, on this rank's mesh.
    Construction is collective (every training rank builds its state together)."""

    def __init__(self, config: Config, spec: StateSpec) -> None:
        from miles.backends.fsdp_utils.model import build_fsdp_model, default_defer_gradient_sync
        from miles.backends.fsdp_utils.parallel import init_distributed

        cfg = self.config = config
        self.spec = spec
        torch.manual_seed(cfg.seed)
        self.ps = ps = init_distributed(
            None,
            cfg.train.train_timeout,
            cfg.train.context_parallel_size,
            cfg.train.tensor_model_parallel_size,
        )
        set_cpu_threads(ps)
        self.param_dtype = param_dtype(cfg.model.train_dtype, ps.is_cuda)
        select_attention_kernel(cfg.model.attn_implementation, ps.is_cuda, ps.cp_size)
        self.model = build_fsdp_model(
            spec.init_path,
            ps.fsdp_mesh,
            cpu_offload=cfg.train.fsdp_cpu_offload,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            device=ps.device,
            flag=spec.init_flag,
            transform=spec.transform,
            **self.model_kwargs(),
        )
        if spec.init_dcp is not None:
            from miles.backends.fsdp_utils.hf_export import load_model_weights

            load_model_weights(spec.init_dcp, self.model)
            logger.info("%s: weights of %s", spec.role, spec.init_dcp)
        if cfg.model.freeze_vision_tower:
            from miles.backends.fsdp_utils.vl_train import freeze_vision_tower

            frozen = freeze_vision_tower(self.model)
            logger.info("%s: --freeze-vision-tower: %d vision parameters frozen", spec.role, frozen)
        self.model.train()
        self.defer_grad_sync = default_defer_gradient_sync(ps.device, cfg.train.fsdp_cpu_offload)
        self.steps_per_rollout = cfg.train.steps_per_rollout  # derived once, at validation
        self.optimizer, self.lr_scheduler = self._build_optimizer()
        self.offloaded = False
        self.resumed_extra_state: dict[str, JSON] = {}

    def model_kwargs(self) -> ModelKwargs:
        """How every model of this rank is built (the reference model too): compute dtype, fp32 gradient
        reduction, SDPA attention (packed forwards switch to miles_varlen; `select_attention_kernel` chose its
        kernel)."""
        return ModelKwargs(
            param_dtype=self.param_dtype,
            reduce_dtype=torch.float32,
            attn_implementation="sdpa",
            tp_mesh=self.ps.tp_mesh,
            ep_size=self.config.train.expert_model_parallel_size,
        )

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, LRScheduler]:
        from miles.backends.fsdp_utils.lr_scheduler import build_lr_scheduler
        from miles.backends.fsdp_utils.model import build_optimizer

        o, spec, num_rollout = self.config.optim, self.spec, self.config.rollout.num_rollout
        optimizer = build_optimizer(
            self.model.parameters(),
            o.optimizer,
            spec.lr,
            o.weight_decay,
            (o.adam_beta1, o.adam_beta2),
            o.adam_eps,
        )
        lr_scheduler = build_lr_scheduler(
            optimizer,
            lr=spec.lr,
            min_lr=spec.min_lr,
            decay_style=o.lr_decay_style,
            total_iters=num_rollout * self.steps_per_rollout,
            warmup_iters=spec.warmup_iters,
            warmup_fraction=spec.warmup_fraction,
            decay_iters=o.lr_decay_iters,
        )
        return optimizer, lr_scheduler

    def fuse_elementwise(self, others: Sequence[torch.nn.Module | None] = ()) -> None:
        """--fused-elementwise on CUDA: compiled elementwise ops in this state's model and `others` (e.g. the
        reference model)."""
        if self.ps.is_cuda and self.config.model.fused_elementwise:
            fuse_models_elementwise([self.model, *others], self.ps.device, self.param_dtype)

    # ------------------------------------------------------------------------------------------------ train
    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def cp(self) -> CPContext | None:
        """This rank's context-parallel group for the packed forwards; None without CP."""
        if self.ps.cp_size == 1:
            return None
        from miles.backends.fsdp_utils.context_parallel import CPContext

        return CPContext(self.ps.cp_group, self.ps.cp_rank, self.ps.cp_size)

    def sync_gradients(self, last_micro_batch: bool) -> None:
        """Before a micro-batch's backward: reduce gradients after it only when it is the step's last (see
        `model.sync_gradients_after`)."""
        from miles.backends.fsdp_utils.model import sync_gradients_after

        sync_gradients_after(self.model, last_micro_batch, self.defer_grad_sync)

    def optimizer_step(self) -> float:
        """The clipped optimizer step (and LR step) of this role; returns the gradient norm before clipping."""
        return clipped_optimizer_step(
            self.model, self.optimizer, self.lr_scheduler, self.config.optim.clip_grad, self.spec.role
        )

    # ------------------------------------------------------------------------------------------------ checkpoint
    def _checkpoint_root(self, root: str) -> str:
        subdir = self.spec.checkpoint_subdir
        return os.path.join(root, subdir) if subdir else root

    def resume(self) -> int:
        """Load the checkpoint under --load (its `checkpoint_subdir`), if there is one; returns the first rollout
        id to train (0 for a fresh start) and keeps the checkpoint's extra state (`resumed_extra_state`)."""
        from miles.backends.fsdp_utils.checkpoint import load_checkpoint

        if not self.config.checkpoint.load:
            return 0
        load_dir = self._checkpoint_root(self.config.checkpoint.load)
        state = load_checkpoint(load_dir, self.model, self.optimizer, self.lr_scheduler)
        if state is None:
            return 0
        start = int(state["next_rollout_id"])
        self.resumed_extra_state = dict(state["extra_state"])
        logger.info("%s resumed from %s at rollout %d", self.spec.role, load_dir, start)
        return start

    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None) -> Path:
        """Model, optimizer, LR schedule and `extra_state` as checkpoint `rollout_id` under --save (its
        `checkpoint_subdir`; every rank; keeps --keep-last); returns the checkpoint's directory."""
        from miles.backends.fsdp_utils.checkpoint import save_checkpoint

        cfg = self.config.checkpoint
        if not cfg.save:
            raise ValueError("save() called without --save")
        return save_checkpoint(
            self._checkpoint_root(cfg.save),
            rollout_id,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            extra_state=dict(extra_state or {}),
            keep_last=cfg.keep_last,
        )

    # ------------------------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Parameters, gradients and optimizer state to host memory (between train calls, colocated)."""
        from miles.backends.fsdp_utils.offload import offload_to_cpu

        offload_to_cpu(self.model, self.optimizer)
        self.offloaded = True

    def wake_up(self) -> None:
        from miles.backends.fsdp_utils.offload import load_to_device

        load_to_device(self.model, self.optimizer, self.ps.device)
        self.offloaded = False


def clipped_optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: LRScheduler,
    clip_grad: float,
    role: str,
) -> float:
    """Clip the gradients to `clip_grad` (global norm over all ranks' shards), step the optimizer unless that
    norm is not finite (then the step is skipped, with a warning naming `role`), clear the gradients and step
    the LR schedule either way. Returns the norm before clipping (`clip_grad_norm_sharded`: one all-reduce)."""
    from miles.backends.fsdp_utils.model import clip_grad_norm_sharded

    grad_norm = clip_grad_norm_sharded(model.parameters(), clip_grad)
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        logger.warning("%s: non-finite grad norm %s: skipping this optimizer step", role, grad_norm.item())
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()
    return float(grad_norm)


def peak_memory(ps: ParallelState) -> dict[str, float]:
    """This rank's `perf/train_peak_rss_gb` (and on CUDA `perf/train_peak_gpu_mem_gb`), already the largest over
    its CP group: `MetricSum.reduce` takes the largest over the DP group, so the result is the largest over the
    training ranks."""
    from miles.utils import perf

    peaks = {"perf/train_peak_rss_gb": perf.peak_rss_gb()}
    if ps.is_cuda:
        peaks["perf/train_peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 1024**3
    if ps.cp_size > 1:
        peak_t = torch.tensor(list(peaks.values()), dtype=torch.float64, device=ps.device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX, group=ps.cp_group)
        peaks = dict(zip(peaks, peak_t.tolist()))
    return peaks


def perf_metrics(
    model: torch.nn.Module,
    batch: RankBatch,
    no_grad_passes: int,
    seconds: float,
    ps: ParallelState,
    dtype: torch.dtype,
) -> dict[str, float]:
    """`perf/forward_passes` of this train call and, on CUDA in bf16 on a GPU of known peak, `perf/mfu` (see
    miles.utils.perf; the peak memory comes from `peak_memory`)."""
    from miles.utils import perf

    # forward-equivalents of this call: forward + backward (3) and each no-grad pass (old, reference log-probs)
    out = {"perf/forward_passes": float(3 + no_grad_passes)}
    if not ps.is_cuda:
        return out
    device_peak = perf.peak_flops(torch.cuda.get_device_name())
    if device_peak is None or dtype != torch.bfloat16:
        return out
    fwd = perf.model_forward_flops(model, [len(t) for t in batch.tokens])
    flops = torch.tensor(fwd * (3 + no_grad_passes), dtype=torch.float64, device=ps.device)
    dist.all_reduce(flops, group=ps.dp_group)  # CP ranks share their samples: count each DP rank once
    out["perf/mfu"] = perf.mfu(float(flops), seconds, ps.world_size, device_peak)
    return out


def select_attention_kernel(attn_implementation: str, is_cuda: bool, cp_size: int) -> None:
    """--attn-implementation -> the packed-attention kernel (attention.select_attention_kernel)."""
    from miles.backends.fsdp_utils.attention import select_attention_kernel as select

    select(attn_implementation, is_cuda, cp_size)


def fuse_models_elementwise(
    models: list[torch.nn.Module | None], device: torch.device, dtype: torch.dtype
) -> None:
    """--fused-elementwise on CUDA: compiled RMSNorm/rotary/SwiGLU in `models` (see fused_ops), or a warning
    naming why not when torch.compile cannot run here (the eager modules stay)."""
    from miles.backends.fsdp_utils.fused_ops import compile_works, fuse_elementwise_ops

    why = compile_works(device, dtype)
    if why is not None:
        logger.warning(
            "--fused-elementwise: torch.compile does not work here (%s); training uses eager ops", why
        )
        return
    for model in models:
        if model is not None:
            fuse_elementwise_ops(model)


def param_dtype(train_dtype: str, is_cuda: bool) -> torch.dtype:
    """--train-dtype -> the compute dtype (auto: bf16 on CUDA, fp32 on CPU); master weights stay fp32."""
    if train_dtype == "auto":
        return torch.bfloat16 if is_cuda else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[train_dtype]


def set_cpu_threads(ps: ParallelState) -> None:
    """On CPU, split the cores between the training ranks (they run side by side), or take the driver's
    MILES_CPU_TRAIN_THREADS (--fully-async leaves the engines' cores to the engines: they generate meanwhile)."""
    if ps.is_cuda:
        return
    cores = os.cpu_count() or 1
    torch.set_num_threads(
        int(os.environ.get(CPU_TRAIN_THREADS_ENV, 0)) or max(1, cores // max(1, ps.world_size))
    )
    if dist.get_rank() == 0:
        logger.info("CPU training: %d threads per rank", torch.get_num_threads())
