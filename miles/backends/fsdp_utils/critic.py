"""The FSDP2 critic (`--advantage-estimator ppo`): the trainer's second role, a value model.

Same public surface as the actor (`init`, `train`, `save`, `sleep`, `wake_up`); `train` returns, beside its
metrics, the values it computed before updating (the "old" values GAE uses), which the driver hands to the actor.

The model is the HF causal LM with its LM head replaced by a zero-initialised ``Linear(hidden, 1)``
(`model.attach_value_head`), initialised from --critic-load (a HF directory, or a DCP checkpoint of a critic)
or --hf-checkpoint, sharded with FSDP2 like the actor, with its own optimizer and LR schedule (--critic-lr,
--critic-lr-warmup-iters). Values are read over exactly the packs the actor uses for its log-probs
(`rollout_batch.plan_steps` on the same samples and settings).

One `train(rollout_id, samples)` call:
  1. plan the optimizer steps and packs; with the current weights compute every sample's values (no grad);
  2. GAE returns (miles.algo, estimator 'ppo') from the rewards and those values;
  3. per step: forward with grad, clipped value loss (miles.algo.value_loss), backward, clip, optimizer step.

Checkpoints live in ``<--save>/critic`` (resumed from ``<--load>/critic``), written and committed like the
actor's, at the same rollout ids.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles.backends.fsdp_utils import rollout_batch as rb
from miles.backends.fsdp_utils.actor import (
    FSDPTrainer,
    _param_dtype,
    _select_attention_kernel,
    _set_cpu_threads,
    clipped_optimizer_step,
    fuse_models_elementwise,
)
from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

CRITIC_SUBDIR = "critic"


class FSDPCritic(FSDPTrainer):
    def init(self, role: str, with_ref: bool) -> int:
        from miles.backends.fsdp_utils.checkpoint import load_checkpoint, read_tracker
        from miles.backends.fsdp_utils.lr_scheduler import build_lr_scheduler
        from miles.backends.fsdp_utils.model import (
            attach_value_head,
            build_fsdp_model,
            build_optimizer,
            default_defer_gradient_sync,
        )
        from miles.backends.fsdp_utils.parallel import init_distributed

        cfg = self.config
        if role != "critic":
            raise ValueError(f"FSDPCritic is the 'critic' role, got {role!r}")
        if with_ref:
            raise ValueError("the critic has no reference model")
        torch.manual_seed(cfg.seed)
        self.ps = ps = init_distributed(None, cfg.train.train_timeout, cfg.train.context_parallel_size)
        _set_cpu_threads(ps)
        self.param_dtype = _param_dtype(cfg.model.train_dtype, ps.is_cuda)
        _select_attention_kernel(cfg.model.attn_implementation, ps.is_cuda, ps.cp_size)
        init_path, init_dcp = _critic_init_source(cfg.critic.critic_load, cfg.model.hf_checkpoint)
        self.model = build_fsdp_model(
            init_path,
            ps.fsdp_mesh,
            param_dtype=self.param_dtype,
            reduce_dtype=torch.float32,
            cpu_offload=cfg.train.fsdp_cpu_offload,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            device=ps.device,
            attn_implementation="sdpa",
            flag="--critic-load" if cfg.critic.critic_load else "--hf-checkpoint",
            transform=attach_value_head,
        )
        if init_dcp is not None:
            from miles.backends.fsdp_utils.hf_export import load_model_weights

            load_model_weights(init_dcp, self.model)
            logger.info("critic: weights of %s", init_dcp)
        self.model.train()
        if ps.is_cuda and cfg.model.fused_elementwise:
            fuse_models_elementwise([self.model], ps.device, self.param_dtype)
        self.defer_grad_sync = default_defer_gradient_sync(ps.device, cfg.train.fsdp_cpu_offload)
        self.ref_model = None
        o, c = cfg.optim, cfg.critic
        lr = c.critic_lr if c.critic_lr is not None else o.lr
        self.optimizer = build_optimizer(
            self.model.parameters(), o.optimizer, lr, o.weight_decay, (o.adam_beta1, o.adam_beta2), o.adam_eps
        )
        r = cfg.rollout
        self.steps_per_rollout = r.rollout_batch_size * r.n_samples_per_prompt // cfg.train.global_batch_size
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer,
            lr=lr,
            min_lr=min(o.min_lr, lr),
            decay_style=o.lr_decay_style,
            total_iters=r.num_rollout * self.steps_per_rollout,
            warmup_iters=c.critic_lr_warmup_iters,
            decay_iters=o.lr_decay_iters,
        )
        self._offloaded = False
        self._weight_updater = None
        start = 0
        if cfg.checkpoint.load:
            load_dir = os.path.join(cfg.checkpoint.load, CRITIC_SUBDIR)
            actor_tracker = read_tracker(cfg.checkpoint.load)
            if actor_tracker is not None and read_tracker(load_dir) is None:
                raise ValueError(
                    f"--load={cfg.checkpoint.load!r} holds an actor checkpoint but no critic one "
                    f"({load_dir}); --advantage-estimator ppo resumes both"
                )
            state = load_checkpoint(load_dir, self.model, self.optimizer, self.lr_scheduler)
            if state is not None:
                start = int(state["next_rollout_id"])
                logger.info("critic resumed from %s at rollout %d", load_dir, start)
        self.reduction = rb.loss_reduction(cfg.algo)
        return start

    def train(  # type: ignore[override]
        self, rollout_id: int, samples: list[Sample]
    ) -> dict[str, dict[str, float] | list[list[float]]]:
        """Train the value model on this rank's samples. Returns ``{"metrics": {...}, "values": B x [L_i]}``:
        the values before this call's update (lists of floats, in `samples` order), which GAE used."""
        from miles.algo import AdvantageInputs, compute_advantages

        if self._offloaded:
            self.wake_up()
        t0 = time.perf_counter()
        cfg, ps = self.config, self.ps
        batch = rb.RankBatch.from_samples(samples, ps.device)
        steps = rb.plan_steps(batch, cfg, ps, self.steps_per_rollout)
        with torch.no_grad():
            old_values = self._values(batch, steps)
        gae = compute_advantages(
            "ppo",
            AdvantageInputs(
                rewards=batch.rewards,
                group_ids=batch.group_ids,
                loss_masks=batch.loss_masks,
                values=old_values,
                gamma=cfg.algo.gamma,
                lambd=cfg.algo.lambd,
            ),
        )
        metrics = rb.MetricSum()
        for step_packs in steps:
            self._critic_step(batch, step_packs, old_values, gae.returns, metrics)
        out = _critic_metrics(metrics, ps.dp_group)
        out["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        out["timing/critic_train"] = time.perf_counter() - t0
        return {"metrics": out, "values": [v.tolist() for v in old_values]}

    def _values(self, batch: rb.RankBatch, steps: list[list[rb.Pack]]) -> list[torch.Tensor]:
        from miles.backends.fsdp_utils.forward import forward_values

        values: list[torch.Tensor | None] = [None] * len(batch)
        for step_packs in steps:
            for pack in step_packs:
                for sample_i, v in zip(pack.indices, forward_values(self.model, pack.packed, cp=self._cp())):
                    values[sample_i] = v.detach().float()
        return values  # type: ignore[return-value]

    def _critic_step(
        self,
        batch: rb.RankBatch,
        step_packs: list[rb.Pack],
        old_values: list[torch.Tensor],
        returns: list[torch.Tensor],
        metrics: rb.MetricSum,
    ) -> None:
        from miles.algo.value_loss import ValueLossInputs, compute_value_loss
        from miles.backends.fsdp_utils.forward import forward_values
        from miles.backends.fsdp_utils.model import sync_gradients_after

        cfg = self.config
        reduction = rb.step_reduction(self.reduction, batch, step_packs, self.ps)
        for mb_index, pack in enumerate(step_packs):
            sync_gradients_after(self.model, mb_index == len(step_packs) - 1, self.defer_grad_sync)
            values = forward_values(self.model, pack.packed, cp=self._cp())
            inputs = ValueLossInputs(
                values=values,
                old_values=[old_values[i] for i in pack.indices],
                returns=[returns[i] for i in pack.indices],
                loss_masks=[batch.loss_masks[i] for i in pack.indices],
            )
            loss, mb_metrics = compute_value_loss(inputs, cfg.critic.value_clip, reduction)
            loss.backward()
            metrics.add(mb_metrics)
        grad_norm = clipped_optimizer_step(
            self.model, self.optimizer, self.lr_scheduler, cfg.optim.clip_grad, "critic"
        )
        metrics.add_value("grad_norm", grad_norm)

    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        self._save_checkpoint(CRITIC_SUBDIR, rollout_id, extra_state)
        dist.barrier()

    def save_hf(self, rollout_id: int) -> None:
        raise ValueError("--save-hf exports the policy; the critic has no HF export")

    def update_weights(
        self, engine_urls: list[str], weight_version: str, resume_tags: Sequence[str] = ()
    ) -> None:
        raise ValueError("the critic does not refit rollout engines")


def _critic_init_source(critic_load: str | None, hf_checkpoint: str) -> tuple[str, Path | None]:
    """(HF directory to build the architecture from, DCP iter dir to load over it or None)."""
    from miles.backends.fsdp_utils.hf_export import resolve_dcp_checkpoint

    if critic_load is None:
        return hf_checkpoint, None
    if os.path.isfile(os.path.join(critic_load, "config.json")):
        return critic_load, None
    dcp_dir = resolve_dcp_checkpoint(critic_load)
    if dcp_dir is None:
        raise ValueError(
            f"--critic-load={critic_load!r}: neither a HuggingFace directory (config.json) nor a DCP checkpoint "
            "of a critic (an iter_N directory, or a <--save>/critic directory)"
        )
    return hf_checkpoint, dcp_dir


def _critic_metrics(metrics: rb.MetricSum, dp_group: ProcessGroup | None) -> dict[str, float]:
    """critic/value_loss, critic/value_clipfrac, critic/grad_norm, critic/explained_variance over the DP group."""
    from miles.algo import stack_metrics, unstack_metrics
    from miles.algo.value_loss import explained_variance

    keys, stacked = stack_metrics(metrics.pairs)
    stacked = rb._all_reduce_sum(stacked, dp_group)
    pairs = unstack_metrics(keys, stacked)
    out = {}
    for key in ("value_loss", "value_clipfrac", "grad_norm"):
        num, den = (float(x) for x in pairs[key])
        if den:
            out[f"critic/{key}"] = num / den
    sums = [float(pairs[k][0]) for k in ("ev_n", "ev_ret", "ev_ret_sq", "ev_err", "ev_err_sq")]
    out["critic/explained_variance"] = explained_variance(*sums)
    return out
