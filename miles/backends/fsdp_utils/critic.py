"""The FSDP2 critic (`--advantage-estimator ppo`): the trainer's value role, an `FSDPState` (state.py) composed
with the values, GAE and the value loss.

Public surface (`miles.backends.base.ValueBackend`): `init`, `train`, `save`, `sleep`, `wake_up`,
`resume_state`; `train` returns a `ValueTrainResult`: beside its metrics, the values it computed before updating
(the "old" values GAE uses), which the driver hands to the actor.

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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles.backends.base import ValueBackend, ValueTrainResult
from miles.backends.fsdp_utils import rollout_batch as rb
from miles.backends.fsdp_utils.state import FSDPState, StateSpec
from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed import ProcessGroup

    from miles.config import Config

logger = logging.getLogger(__name__)

CRITIC_SUBDIR = "critic"


class FSDPCritic(ValueBackend):
    def init(self, role: str, with_ref: bool) -> int:
        from miles.backends.fsdp_utils.checkpoint import read_tracker

        cfg = self.config
        if role != "critic":
            raise ValueError(f"FSDPCritic is the 'critic' role, got {role!r}")
        if with_ref:
            raise ValueError("the critic has no reference model")
        self.state = FSDPState(cfg, critic_spec(cfg))
        self.state.fuse_elementwise()
        if cfg.checkpoint.load:
            load_dir = os.path.join(cfg.checkpoint.load, CRITIC_SUBDIR)
            actor_tracker = read_tracker(cfg.checkpoint.load)
            if actor_tracker is not None and read_tracker(load_dir) is None:
                raise ValueError(
                    f"--load={cfg.checkpoint.load!r} holds an actor checkpoint but no critic one "
                    f"({load_dir}); --advantage-estimator ppo resumes both"
                )
        start = self.state.resume()
        self.reduction = rb.loss_reduction(cfg.algo)
        return start

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model

    def train(self, rollout_id: int, samples: list[Sample]) -> ValueTrainResult:
        """Train the value model on this rank's samples. Returns ``{"metrics": {...}, "values": B x [L_i]}``:
        the values before this call's update (lists of floats, in `samples` order), which GAE used."""
        from miles.algo import AdvantageInputs, compute_advantages

        if self.state.offloaded:
            self.wake_up()
        t0 = time.perf_counter()
        cfg, ps = self.config, self.state.ps
        batch = rb.RankBatch.from_samples(samples, ps.device)
        steps = rb.plan_steps(batch, cfg, ps, self.state.steps_per_rollout)
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
        out["critic/lr"] = self.state.optimizer.param_groups[0]["lr"]
        out["timing/critic_train"] = time.perf_counter() - t0
        return {"metrics": out, "values": [v.tolist() for v in old_values]}

    def _values(self, batch: rb.RankBatch, steps: list[list[rb.Pack]]) -> list[torch.Tensor]:
        from miles.backends.fsdp_utils.forward import forward_values

        values: list[torch.Tensor | None] = [None] * len(batch)
        for step_packs in steps:
            for pack in step_packs:
                for sample_i, v in zip(
                    pack.indices, forward_values(self.model, pack.packed, cp=self.state.cp())
                ):
                    values[sample_i] = v.detach().float()
        return values

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

        cfg = self.config
        reduction = rb.step_reduction(
            self.reduction, batch, step_packs, self.state.ps, variable=cfg.rollout.use_session_server
        )
        for mb_index, pack in enumerate(step_packs):
            self.state.sync_gradients(mb_index == len(step_packs) - 1)
            values = forward_values(self.model, pack.packed, cp=self.state.cp())
            inputs = ValueLossInputs(
                values=values,
                old_values=[old_values[i] for i in pack.indices],
                returns=[returns[i] for i in pack.indices],
                loss_masks=[batch.loss_masks[i] for i in pack.indices],
            )
            loss, mb_metrics = compute_value_loss(inputs, cfg.critic.value_clip, reduction)
            loss.backward()
            metrics.add(mb_metrics)
        metrics.add_value("grad_norm", self.state.optimizer_step())

    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        self.state.save(rollout_id, extra_state)
        dist.barrier()

    def resume_state(self) -> dict[str, JSON]:
        return dict(self.state.resumed_extra_state)

    def sleep(self) -> None:
        self.state.sleep()

    def wake_up(self) -> None:
        self.state.wake_up()


def critic_spec(cfg: Config) -> StateSpec:
    """The critic's training state: --critic-load (or --hf-checkpoint) with a value head, --critic-lr (default
    --lr) and --critic-lr-warmup-iters, checkpoints in <--save>/critic and <--load>/critic."""
    from miles.backends.fsdp_utils.model import attach_value_head

    o, c = cfg.optim, cfg.critic
    init_path, init_dcp = _critic_init_source(c.critic_load, cfg.model.hf_checkpoint)
    lr = c.critic_lr  # --lr when not given (resolved at validation)
    return StateSpec(
        role="critic",
        init_path=init_path,
        init_flag="--critic-load" if c.critic_load else "--hf-checkpoint",
        transform=attach_value_head,
        lr=lr,
        min_lr=min(o.min_lr, lr),
        warmup_iters=c.critic_lr_warmup_iters,
        checkpoint_subdir=CRITIC_SUBDIR,
        init_dcp=init_dcp,
    )


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
