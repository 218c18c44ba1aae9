"""The FSDP2 policy (`--train-backend fsdp`, the 'actor' role): an `FSDPState` (state.py) composed with the
reference model, the algorithm (`miles.algo`, resolved once by `rollout_batch.trainer_algo`) and the refit of the
rollout engines.

Public surface (`miles.backends.base.PolicyBackend`): `init`, `train`, `save`, `save_hf`, `sleep`, `wake_up`,
`update_weights`, `resume_state`. Everything else is private. The loss is not written here: `_train_step` calls
`miles.algo`.

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
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles.backends.base import PolicyBackend
from miles.backends.fsdp_utils import rollout_batch as rb
from miles.backends.fsdp_utils.moe import MoETraining
from miles.backends.fsdp_utils.state import FSDPState, StateSpec, peak_memory, perf_metrics
from miles.backends.fsdp_utils.vl_packing import is_vl_model
from miles.backends.fsdp_utils.vl_train import forward_pack, load_image_processor, sample_images
from miles.utils.progress import ProgressBar, progress_bar
from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from miles.backends.fsdp_utils.lora import MergedView
    from miles.backends.fsdp_utils.parallel import ParallelState
    from miles.backends.fsdp_utils.state import ModelKwargs
    from miles.config import Config
    from miles.config.sections import LoraConfig
    from miles.refit.lora_adapter import AdapterRefitter
    from miles.refit.refitter import Refitter

logger = logging.getLogger(__name__)


class FSDPTrainer(PolicyBackend):
    # ------------------------------------------------------------------------------------------------ init
    def init(self, role: str, with_ref: bool) -> int:
        cfg = self.config
        if role != "actor":
            raise ValueError(f"FSDPTrainer is the 'actor' role, got {role!r} (the critic is FSDPCritic)")
        self.lora = cfg.lora.lora_rank > 0
        self.state = FSDPState(cfg, policy_spec(cfg))
        self.image_processor = None  # a VL model's: re-processes the samples' images (vl_train.sample_images)
        if is_vl_model(self.state.model):
            self.image_processor = load_image_processor(cfg.model.hf_checkpoint)
        self.ref_model: torch.nn.Module | None = None
        # with LoRA the reference is the frozen base: the policy with its adapters switched off
        self.ref_is_base = with_ref and self.lora
        if with_ref and not self.lora:
            self.ref_model = _build_reference(cfg, self.ps.fsdp_mesh, self.state.model_kwargs())
        self.state.fuse_elementwise([self.ref_model])
        t = cfg.train  # MoE: router losses and routing replay (no-ops for a dense model)
        self.moe = MoETraining(
            self.state.model,
            t.moe_aux_loss_coeff,
            t.moe_z_loss_coeff,
            cfg.rollout.use_rollout_routing_replay,
            t.use_routing_replay,
            cp=self.state.cp(),
        )
        # read the old log-probs off the training forward when that is provably the same pass (see
        # rb.old_log_probs_from_training_forward); tests switch it off to compare against the separate pass
        self.reuse_training_forward = True
        self._refitter: Refitter | None = None  # built at the first refit
        self._adapter_refit: AdapterRefitter | None = None  # --lora-refit adapter: built with the refitter
        start = self.state.resume()
        self.algo = rb.trainer_algo(cfg)  # the loss records and the user functions, resolved once
        return start

    # what tests, tools and the refit read of the state
    @property
    def model(self) -> torch.nn.Module:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def ps(self) -> ParallelState:
        return self.state.ps

    @property
    def param_dtype(self) -> torch.dtype:
        return self.state.param_dtype

    @property
    def steps_per_rollout(self) -> int:
        return self.state.steps_per_rollout

    # ------------------------------------------------------------------------------------------------ train
    def train(
        self, rollout_id: int, samples: list[Sample], values: list[list[float]] | None = None
    ) -> dict[str, float]:
        """`values`: the critic's values of these samples (--advantage-estimator ppo), from `FSDPCritic.train`."""
        if self.state.offloaded:
            self.wake_up()
        t0 = time.perf_counter()
        cfg, ps = self.config, self.ps
        if ps.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        batch = rb.RankBatch.from_samples(samples, ps.device)
        if self.image_processor is not None:
            batch.images = sample_images(samples, self.image_processor)
        rb.attach_values(batch, values)
        self.moe.start_batch([s.rollout_routed_experts for s in samples])
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
        out = metrics.reduce(ps.dp_group, batch, maxima=peak_memory(ps))
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        interval = cfg.train.ref_update_interval
        if self.ref_model is not None and interval and (rollout_id + 1) % interval == 0:
            self._update_reference_model()
        out["timing/train_logprob_prep"] = t_prep
        passes = (not reuse) + has_ref  # no-grad forwards: old, reference log-probs
        out.update(perf_metrics(self.model, batch, passes, time.perf_counter() - t0, ps, self.param_dtype))
        return out

    def _log_probs(self, model, batch: rb.RankBatch, steps: list[list[rb.Pack]]) -> list[torch.Tensor]:
        """Log-probs of every sample's response under `model`, over exactly the packs training will use."""
        temperature = self.config.rollout.rollout_temperature
        log_probs: list[torch.Tensor | None] = [None] * len(batch)
        for step_packs in steps:
            for pack in step_packs:
                # the policy's passes replay routing (R3, --use-routing-replay); the reference routes its own
                moe = self.moe.forward(batch.tokens, pack.indices) if model is self.model else nullcontext()
                with moe:
                    images = batch.pack_images(pack.indices)
                    lp, _ = forward_pack(model, pack.packed, images, temperature, self.state.cp())
                for sample_i, values in zip(pack.indices, lp):
                    log_probs[sample_i] = values.detach().float()
        return log_probs

    @torch.no_grad()
    def _update_reference_model(self) -> None:
        """--ref-update-interval: the reference model takes the actor's current weights (shard by shard: both
        modules are sharded on the same mesh, so local shards correspond one to one)."""
        assert self.ref_model is not None  # called only when there is one
        ref_params = dict(self.ref_model.named_parameters())
        for name, param in self.model.named_parameters():
            target = ref_params[name]
            dst = target.to_local() if hasattr(target, "to_local") else target
            src = param.to_local() if hasattr(param, "to_local") else param
            dst.copy_(src.detach().to(dst.device))
        logger.info("reference model updated from the actor")

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
        cfg = self.config
        temperature = cfg.rollout.rollout_temperature
        settings = rb.step_settings(
            self.algo.loss, batch, step_packs, self.ps, variable=cfg.rollout.use_session_server
        )
        for mb_index, pack in enumerate(step_packs):
            self.state.sync_gradients(mb_index == len(step_packs) - 1)
            # entropy is always reported; it enters the loss only with --entropy-coef
            with self.moe.forward(batch.tokens, pack.indices) as routing:
                log_probs, entropy = forward_pack(
                    self.model,
                    pack.packed,
                    batch.pack_images(pack.indices),
                    temperature,
                    self.state.cp(),
                    with_entropy=True,
                )
            if fill_old:
                assert batch.old_log_probs is not None  # `train` made room for them
                for sample_i, values in zip(pack.indices, log_probs):
                    batch.old_log_probs[sample_i] = values.detach().float()
            inputs = batch.loss_inputs(pack.indices, log_probs, entropy)
            loss, mb_metrics = self.algo.loss_fn(inputs, settings)
            router_loss, moe_metrics = self.moe.loss(routing, len(step_packs))
            if router_loss is not None:
                loss = loss + router_loss
            for key, value in moe_metrics.items():
                metrics.add_value(key, value)
            loss.backward()
            metrics.add(mb_metrics)
            if first_step and mb_index == 0:
                # the weights have not moved yet: old and new log-probs must agree bit for bit
                diff = float((torch.cat(inputs.old_log_probs) - torch.cat(log_probs).detach()).abs().max())
                metrics.add_value("first_mb_ppo_kl_abs_max", diff)
            if bar is not None:
                bar.update()
        metrics.add_value("grad_norm", self.state.optimizer_step())

    # ------------------------------------------------------------------------------------------------ save
    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        final = self.state.save(rollout_id, extra_state)
        # config + tokenizer beside the weights: the checkpoint converts to HF on its own
        if self.ps.rank == 0:
            from miles.backends.fsdp_utils.hf_export import write_checkpoint_hf_files

            write_checkpoint_hf_files(final, self.config.model.hf_checkpoint, self.param_dtype)
            if self.lora:  # the adapters' settings and base, so the checkpoint merges/exports on its own
                from miles.backends.fsdp_utils.lora_export import write_adapter_config

                write_adapter_config(final, self.model, self.config.lora, self.config.model.hf_checkpoint)
        dist.barrier()

    def resume_state(self) -> dict[str, JSON]:
        return dict(self.state.resumed_extra_state)

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
        self.state.sleep()

    def wake_up(self) -> None:
        self.state.wake_up()

    # ------------------------------------------------------------------------------------------------ refit
    def update_weights(
        self,
        engine_urls: list[str],
        weight_version: str,
        resume_tags: Sequence[str] = (),
        flush_cache: bool = True,
    ) -> dict[str, float]:
        """Refit ``engine_urls`` (all engines, or the restarted ones) through `miles.refit`, the model awake
        meanwhile. ``resume_tags``: resumed on every engine before the weights move
        (`WeightUpdater.resume_engines`), all ranks raising the error; ``flush_cache`` False under an in_place pause (see `PolicyBackend.update_weights`)."""
        was_offloaded = self.state.offloaded
        if was_offloaded:
            self.wake_up()
        if self._refitter is None:
            from miles.refit.refitter import make_refitter

            ps = self.ps
            self._refitter = make_refitter(self.config, ps.rank, ps.world_size, ps.is_cuda, self.param_dtype)
            if self.lora and self.config.lora.lora_refit == "adapter":
                from miles.refit.lora_adapter import AdapterRefitter

                self._adapter_refit = AdapterRefitter(self._refitter, self.config.log.run_dir)
        if self._adapter_refit is not None:
            self._update_adapter(weight_version, engine_urls, resume_tags)
        else:
            self._refitter.update(self._refit_source(), weight_version, engine_urls, resume_tags, flush_cache)
        if was_offloaded:
            self.sleep()
        return self._refitter.metrics()

    def _update_adapter(self, version: str, engine_urls: list[str], resume_tags: Sequence[str]) -> None:
        """--lora-refit adapter: the base once, then only the adapter (`miles.refit.lora_adapter`)."""
        from miles.backends.fsdp_utils.lora import BaseView, adapter_config, gathered_adapters

        assert self._adapter_refit is not None
        lora, model = self.config.lora, self.model
        config = adapter_config(
            model, lora.lora_rank, lora.lora_alpha, lora.lora_dropout, self.config.model.hf_checkpoint
        )
        tensors = lambda: gathered_adapters(model, self.param_dtype)  # noqa: E731 - collective, run by the refit
        self._adapter_refit.update(BaseView(model), tensors, config, version, engine_urls, resume_tags)

    def _refit_source(self) -> torch.nn.Module | MergedView:
        """What refits and HF exports read: the model, or with LoRA its merged view (base names, W + s*B@A)."""
        if not self.lora:
            return self.model
        from miles.backends.fsdp_utils.lora import MergedView

        return MergedView(self.model)


def policy_spec(cfg: Config) -> StateSpec:
    """The policy's training state: --hf-checkpoint (with LoRA adapters under --lora-rank), --lr and its warmup,
    checkpoints at the top of --save / --load."""
    o = cfg.optim
    return StateSpec(
        role="actor",
        init_path=cfg.model.hf_checkpoint,
        init_flag="--hf-checkpoint",
        transform=_lora_transform(cfg.lora) if cfg.lora.lora_rank > 0 else None,
        lr=o.lr,
        min_lr=o.min_lr,
        warmup_iters=o.lr_warmup_iters,
        warmup_fraction=o.lr_warmup_fraction,
    )


def _lora_transform(lora: LoraConfig) -> Callable[[torch.nn.Module], None]:
    from miles.backends.fsdp_utils.lora import apply_lora

    def transform(model: torch.nn.Module) -> None:
        n = apply_lora(
            model, lora.lora_rank, lora.lora_alpha, list(lora.lora_target_modules), lora.lora_dropout
        )
        logger.info("LoRA rank %d on %d linear layers (%s)", lora.lora_rank, n, lora.lora_target_modules)

    return transform


def hf_export_dir(save_hf: str, rollout_id: int) -> str:
    """Where --save-hf writes rollout `rollout_id`: the path formatted with {rollout_id} when it has that field,
    else `<save_hf>/iter_<rollout_id:07d>` (the checkpoint naming)."""

    if "{rollout_id" in save_hf:
        return save_hf.format(rollout_id=rollout_id)
    return os.path.join(save_hf, f"iter_{rollout_id:07d}")


def _build_reference(cfg: Config, mesh: DeviceMesh, model_kwargs: ModelKwargs) -> torch.nn.Module:
    """The frozen reference: --ref-load as a HF directory, or a DCP checkpoint (a --save dir or one iter_N)
    loaded into the --hf-checkpoint architecture; None: --hf-checkpoint itself."""

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
