"""The FSDP2 training backend (`--train-backend fsdp`).

Public surface (miles/backends/base.py): `init`, `train`, `save`, `save_hf`, `sleep`, `wake_up`,
`update_weights`. Everything else is private. The loss is not written here: `_train_step` calls `miles.algo`.

One `train(rollout_id, data)` call:
  1. split the rank's samples into optimizer steps of `global_batch_size / dp` samples and plan each step's packs
     (micro-batches) once;
  2. with the weights the rollout used, compute old log-probs (and reference log-probs) over exactly those packs,
     so the first micro-batch sees ppo_kl == 0 bit for bit; with one optimizer step per rollout (and no
     KL-in-reward or custom advantage reading them) the old log-probs are instead each micro-batch's own
     training forward, detached: the same numbers without the extra pass (rb.old_log_probs_from_training_forward);
  3. advantages (miles.algo), whitened over the DP group where the estimator asks for it;
  4. per step: forward each pack with grad, loss (miles.algo.loss), backward; clip; optimizer + LR step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles.backends.base import TrainBackend
from miles.backends.fsdp_utils import rollout_batch as rb
from miles.utils.progress import ProgressBar, progress_bar
from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed.device_mesh import DeviceMesh

    from miles.backends.fsdp_utils.lora import MergedView
    from miles.backends.fsdp_utils.lr_scheduler import LRScheduler
    from miles.backends.fsdp_utils.parallel import ParallelState
    from miles.config import Config
    from miles.config.sections import LoraConfig
    from miles.refit.refitter import Refitter

logger = logging.getLogger(__name__)


class FSDPTrainer(TrainBackend):
    # ------------------------------------------------------------------------------------------------ init
    def init(self, role: str, with_ref: bool) -> int:
        from miles.backends.fsdp_utils.checkpoint import load_checkpoint
        from miles.backends.fsdp_utils.lr_scheduler import build_lr_scheduler
        from miles.backends.fsdp_utils.model import (
            build_fsdp_model,
            build_optimizer,
            default_defer_gradient_sync,
        )
        from miles.backends.fsdp_utils.parallel import init_distributed

        cfg = self.config
        if role != "actor":
            raise ValueError(f"FSDPTrainer is the 'actor' role, got {role!r} (the critic is FSDPCritic)")
        torch.manual_seed(cfg.seed)
        self.ps = ps = init_distributed(None, cfg.train.train_timeout, cfg.train.context_parallel_size)
        _set_cpu_threads(ps)
        self.param_dtype = _param_dtype(cfg.model.train_dtype, ps.is_cuda)
        _select_attention_kernel(cfg.model.attn_implementation, ps.is_cuda, ps.cp_size)
        model_kwargs = dict(
            param_dtype=self.param_dtype,
            reduce_dtype=torch.float32,
            attn_implementation="sdpa",  # packed forwards switch to miles_varlen; the kernel is chosen above
        )
        self.lora = cfg.lora.lora_rank > 0
        self.model = build_fsdp_model(
            cfg.model.hf_checkpoint,
            ps.fsdp_mesh,
            cpu_offload=cfg.train.fsdp_cpu_offload,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            device=ps.device,
            transform=_lora_transform(cfg.lora) if self.lora else None,
            **model_kwargs,
        )
        self.model.train()
        self.defer_grad_sync = default_defer_gradient_sync(ps.device, cfg.train.fsdp_cpu_offload)
        self.ref_model = None
        # with LoRA the reference is the frozen base: the policy with its adapters switched off
        self.ref_is_base = with_ref and self.lora
        if with_ref and not self.lora:
            self.ref_model = _build_reference(cfg, ps.fsdp_mesh, model_kwargs)
        if ps.is_cuda and cfg.model.fused_elementwise:
            fuse_models_elementwise([self.model, self.ref_model], ps.device, self.param_dtype)
        o = cfg.optim
        self.optimizer = build_optimizer(
            self.model.parameters(),
            o.optimizer,
            o.lr,
            o.weight_decay,
            (o.adam_beta1, o.adam_beta2),
            o.adam_eps,
        )
        r = cfg.rollout
        self.steps_per_rollout = r.rollout_batch_size * r.n_samples_per_prompt // cfg.train.global_batch_size
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer,
            lr=o.lr,
            min_lr=o.min_lr,
            decay_style=o.lr_decay_style,
            total_iters=r.num_rollout * self.steps_per_rollout,
            warmup_iters=o.lr_warmup_iters,
            warmup_fraction=o.lr_warmup_fraction,
            decay_iters=o.lr_decay_iters,
        )
        # read the old log-probs off the training forward when that is provably the same pass (see
        # rb.old_log_probs_from_training_forward); tests switch it off to compare against the separate pass
        self.reuse_training_forward = True
        self._offloaded = False
        self._refitter: Refitter | None = None  # built at the first refit
        start = 0
        if cfg.checkpoint.load:
            state = load_checkpoint(cfg.checkpoint.load, self.model, self.optimizer, self.lr_scheduler)
            if state is not None:
                start = int(state["next_rollout_id"])
                self._resumed_extra_state = dict(state["extra_state"])
                logger.info("resumed from %s at rollout %d", cfg.checkpoint.load, start)
        self.algo = rb.trainer_algo(cfg)  # the loss records and the user functions, resolved once
        return start

    # ------------------------------------------------------------------------------------------------ train
    def train(
        self, rollout_id: int, samples: list[Sample], values: list[list[float]] | None = None
    ) -> dict[str, float]:
        """`values`: the critic's values of these samples (--advantage-estimator ppo), from `FSDPCritic.train`."""
        if self._offloaded:
            self.wake_up()
        t0 = time.perf_counter()
        cfg, ps = self.config, self.ps
        if ps.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        batch = rb.RankBatch.from_samples(samples, ps.device)
        rb.attach_values(batch, values)
        if cfg.algo.advantage_estimator == "ppo" and batch.values is None:
            raise ValueError("--advantage-estimator ppo: the actor was given no critic values")
        steps = rb.plan_steps(batch, cfg, ps, self.steps_per_rollout)
        has_ref = self.ref_model is not None or self.ref_is_base
        reuse = self.reuse_training_forward and rb.old_log_probs_from_training_forward(
            len(steps), cfg, has_ref
        )
        with torch.no_grad():
            if not reuse:
                batch.old_log_probs = self._log_probs(self.model, batch, steps)
            if self.ref_model is not None:
                batch.ref_log_probs = self._log_probs(self.ref_model, batch, steps)
            elif self.ref_is_base:
                from miles.backends.fsdp_utils.lora import adapters_disabled

                with adapters_disabled(self.model):
                    batch.ref_log_probs = self._log_probs(self.model, batch, steps)
        if cfg.algo.use_rollout_logprobs:
            batch.require_rollout_log_probs()
        rb.compute_advantages_for(batch, cfg.algo, self.algo.advantage_fn, ps.dp_group)
        if reuse:  # filled micro-batch by micro-batch from the training forward (see _train_step)
            batch.old_log_probs = [None] * len(batch)
        t_prep = time.perf_counter() - t0

        metrics = rb.MetricSum()
        num_packs = sum(len(step_packs) for step_packs in steps)
        with progress_bar(num_packs, f"train {rollout_id}", unit="mb", enabled=ps.rank == 0) as bar:
            for step_index, step_packs in enumerate(steps):
                self._train_step(
                    batch, step_packs, metrics, first_step=step_index == 0, bar=bar, fill_old=reuse
                )
        # with the advantage statistics and the peak memory over the DP group: one all-reduce
        out = metrics.reduce(ps.dp_group, batch, maxima=_peak_memory(ps))
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        interval = cfg.train.ref_update_interval
        if self.ref_model is not None and interval and (rollout_id + 1) % interval == 0:
            self._update_reference_model()
        out["timing/train_logprob_prep"] = t_prep
        passes = (not reuse) + has_ref  # no-grad forwards: old, reference log-probs
        out.update(_perf_metrics(self.model, batch, passes, time.perf_counter() - t0, ps, self.param_dtype))
        return out

    def _log_probs(self, model, batch: rb.RankBatch, steps: list[list[rb.Pack]]) -> list[torch.Tensor]:
        """Log-probs of every sample's response under `model`, over exactly the packs training will use."""
        from miles.backends.fsdp_utils.forward import forward_packed

        temperature = self.config.rollout.rollout_temperature
        log_probs: list[torch.Tensor | None] = [None] * len(batch)
        for step_packs in steps:
            for pack in step_packs:
                lp, _ = forward_packed(model, pack.packed, temperature, cp=self._cp())
                for sample_i, values in zip(pack.indices, lp):
                    log_probs[sample_i] = values.detach().float()
        return log_probs

    @torch.no_grad()
    def _update_reference_model(self) -> None:
        """--ref-update-interval: the reference model takes the actor's current weights (shard by shard: both
        modules are sharded on the same mesh, so local shards correspond one to one)."""
        ref_params = dict(self.ref_model.named_parameters())
        for name, param in self.model.named_parameters():
            target = ref_params[name]
            dst = target.to_local() if hasattr(target, "to_local") else target
            src = param.to_local() if hasattr(param, "to_local") else param
            dst.copy_(src.detach().to(dst.device))
        logger.info("reference model updated from the actor")

    def _cp(self):
        if self.ps.cp_size == 1:
            return None
        from miles.backends.fsdp_utils.context_parallel import CPContext

        return CPContext(self.ps.cp_group, self.ps.cp_rank, self.ps.cp_size)

    def _train_step(
        self,
        batch: rb.RankBatch,
        step_packs: list[rb.Pack],
        metrics: rb.MetricSum,
        first_step: bool,
        bar: ProgressBar | None = None,
        fill_old: bool = False,
    ) -> None:
        """One optimizer step over `step_packs`. `fill_old`: each micro-batch's detached log-probs become its
        old log-probs (only valid when `rb.old_log_probs_from_training_forward` holds)."""
        from miles.backends.fsdp_utils.forward import forward_packed
        from miles.backends.fsdp_utils.model import sync_gradients_after

        cfg = self.config
        temperature = cfg.rollout.rollout_temperature
        settings = rb.step_settings(self.algo.loss, batch, step_packs, self.ps)
        for mb_index, pack in enumerate(step_packs):
            sync_gradients_after(self.model, mb_index == len(step_packs) - 1, self.defer_grad_sync)
            # entropy is always reported; it enters the loss only with --entropy-coef
            log_probs, entropy = forward_packed(
                self.model, pack.packed, temperature, cp=self._cp(), with_entropy=True
            )
            if fill_old:
                for sample_i, values in zip(pack.indices, log_probs):
                    batch.old_log_probs[sample_i] = values.detach().float()
            inputs = batch.loss_inputs(pack.indices, log_probs, entropy)
            loss, mb_metrics = self.algo.loss_fn(inputs, settings)
            loss.backward()
            metrics.add(mb_metrics)
            if first_step and mb_index == 0:
                # the weights have not moved yet: old and new log-probs must agree bit for bit
                diff = float((torch.cat(inputs.old_log_probs) - torch.cat(log_probs).detach()).abs().max())
                metrics.add_value("first_mb_ppo_kl_abs_max", diff)
            if bar is not None:
                bar.update()
        grad_norm = clipped_optimizer_step(
            self.model, self.optimizer, self.lr_scheduler, cfg.optim.clip_grad, "actor"
        )
        metrics.add_value("grad_norm", grad_norm)

    # ------------------------------------------------------------------------------------------------ save
    def _save_checkpoint(self, subdir: str, rollout_id: int, extra_state: dict[str, JSON] | None) -> Path:
        """Model, optimizer, LR schedule and `extra_state` as checkpoint `rollout_id` under `--save`/`subdir`
        (every rank; keeps --keep-last); returns the checkpoint's directory."""
        from miles.backends.fsdp_utils.checkpoint import save_checkpoint

        cfg = self.config.checkpoint
        if not cfg.save:
            raise ValueError("save() called without --save")
        return save_checkpoint(
            os.path.join(cfg.save, subdir) if subdir else cfg.save,
            rollout_id,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            extra_state=dict(extra_state or {}),
            keep_last=cfg.keep_last,
        )

    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        final = self._save_checkpoint("", rollout_id, extra_state)
        # config + tokenizer beside the weights: the checkpoint converts to HF on its own
        if self.ps.rank == 0:
            from miles.backends.fsdp_utils.hf_export import write_checkpoint_hf_files

            write_checkpoint_hf_files(final, self.config.model.hf_checkpoint, self.param_dtype)
            if self.lora:  # the adapters' settings and base, so the checkpoint merges/exports on its own
                from miles.backends.fsdp_utils.lora_export import write_adapter_config

                write_adapter_config(final, self.model, self.config.lora, self.config.model.hf_checkpoint)
        dist.barrier()

    def save_hf(self, rollout_id: int) -> None:
        """--save-hf: the policy as a HF directory, gathered bucket by bucket (rank 0 writes)."""
        from miles.backends.fsdp_utils.hf_export import export_sharded_model

        cfg = self.config
        if not cfg.checkpoint.save_hf:
            raise ValueError("save_hf() called without --save-hf")
        export_sharded_model(
            self._refit_source(),
            hf_export_dir(cfg.checkpoint.save_hf, rollout_id),
            cfg.model.hf_checkpoint,
            self.param_dtype,
            bucket_bytes=cfg.train.update_weight_buffer_size,
        )

    # ------------------------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        from miles.backends.fsdp_utils.offload import offload_to_cpu

        offload_to_cpu(self.model, self.optimizer)
        self._offloaded = True

    def wake_up(self) -> None:
        from miles.backends.fsdp_utils.offload import load_to_device

        load_to_device(self.model, self.optimizer, self.ps.device)
        self._offloaded = False

    # ------------------------------------------------------------------------------------------------ refit
    def update_weights(
        self, engine_urls: list[str], weight_version: str, resume_tags: Sequence[str] = ()
    ) -> None:
        """Refit ``engine_urls`` (all engines, or the restarted ones) through `miles.refit`, the model awake
        meanwhile. ``resume_tags``: rank 0 resumes them on every engine before the weights move, all ranks
        raising its error (see `TrainBackend.update_weights`)."""
        was_offloaded = self._offloaded
        if was_offloaded:
            self.wake_up()
        if self._refitter is None:
            from miles.refit.refitter import make_refitter

            ps = self.ps
            self._refitter = make_refitter(self.config, ps.rank, ps.world_size, ps.is_cuda, self.param_dtype)
        self._refitter.update(self._refit_source(), weight_version, engine_urls, resume_tags)
        if was_offloaded:
            self.sleep()

    def _refit_source(self) -> torch.nn.Module | MergedView:
        """What refits and HF exports read: the model, or with LoRA its merged view (base names, W + s*B@A)."""
        if not self.lora:
            return self.model
        from miles.backends.fsdp_utils.lora import MergedView

        return MergedView(self.model)


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


def _peak_memory(ps: ParallelState) -> dict[str, float]:
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


def _perf_metrics(
    model: torch.nn.Module,
    batch: rb.RankBatch,
    no_grad_passes: int,
    seconds: float,
    ps: ParallelState,
    dtype: torch.dtype,
) -> dict[str, float]:
    """`perf/forward_passes` of this train call and, on CUDA in bf16 on a GPU of known peak, `perf/mfu` (see
    miles.utils.perf; the peak memory comes from `_peak_memory`)."""
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


def _lora_transform(lora: LoraConfig) -> Callable[[torch.nn.Module], None]:
    from miles.backends.fsdp_utils.lora import apply_lora

    def transform(model: torch.nn.Module) -> None:
        n = apply_lora(
            model, lora.lora_rank, lora.lora_alpha, list(lora.lora_target_modules), lora.lora_dropout
        )
        logger.info("LoRA rank %d on %d linear layers (%s)", lora.lora_rank, n, lora.lora_target_modules)

    return transform


def _select_attention_kernel(attn_implementation: str, is_cuda: bool, cp_size: int) -> None:
    """--attn-implementation -> the packed-attention kernel (attention.select_attention_kernel)."""
    from miles.backends.fsdp_utils.attention import select_attention_kernel

    select_attention_kernel(attn_implementation, is_cuda, cp_size)


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


def _param_dtype(train_dtype: str, is_cuda: bool) -> torch.dtype:
    if train_dtype == "auto":
        return torch.bfloat16 if is_cuda else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[train_dtype]


def hf_export_dir(save_hf: str, rollout_id: int) -> str:
    """Where --save-hf writes rollout `rollout_id`: the path formatted with {rollout_id} when it has that field,
    else `<save_hf>/iter_<rollout_id:07d>` (the checkpoint naming)."""
    import os

    if "{rollout_id" in save_hf:
        return save_hf.format(rollout_id=rollout_id)
    return os.path.join(save_hf, f"iter_{rollout_id:07d}")


def _build_reference(cfg: Config, mesh: DeviceMesh, model_kwargs: dict[str, object]) -> torch.nn.Module:
    """The frozen reference: --ref-load as a HF directory, or a DCP checkpoint (a --save dir or one iter_N)
    loaded into the --hf-checkpoint architecture; None: --hf-checkpoint itself."""
    import os

    from miles.backends.fsdp_utils.hf_export import load_model_weights, resolve_dcp_checkpoint
    from miles.backends.fsdp_utils.model import build_reference_model

    path = cfg.checkpoint.ref_load or cfg.model.hf_checkpoint
    if os.path.isfile(os.path.join(path, "config.json")):
        return build_reference_model(path, mesh, **model_kwargs)
    dcp_dir = resolve_dcp_checkpoint(path)
    if dcp_dir is None:
        raise ValueError(
            f"--ref-load={path!r}: neither a HuggingFace directory (config.json) nor a DCP checkpoint "
            "(an iter_N directory, or a --save directory with latest_checkpointed_iteration.txt)"
        )
    model = build_reference_model(cfg.model.hf_checkpoint, mesh, **model_kwargs)
    load_model_weights(dcp_dir, model)
    logger.info("reference model: weights of %s", dcp_dir)
    return model


def _set_cpu_threads(ps: ParallelState) -> None:
    """On CPU, split the cores between the training ranks (they run side by side)."""
    if ps.is_cuda:
        return
    import os

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, ps.world_size)))
    if dist.get_rank() == 0:
        logger.info("CPU training: %d threads per rank", torch.get_num_threads())
