"""One DP rank's share of a rollout, as tensors, and the per-step bookkeeping of the FSDP trainer.

Private to the FSDP backend: turns the rank's `Sample` records into per-sample tensors, plans optimizer steps and packs,
computes advantages with `miles.algo`, all-reduces counts/statistics over the DP group, and sums metrics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles.algo import (
    MIS,
    OPSM,
    TIS,
    AdvantageInputs,
    CustomMismatch,
    KLPenalty,
    LossFn,
    LossInputs,
    LossReduction,
    LossSettings,
    Mismatch,
    PolicyLossSpec,
    TISAndMIS,
    accumulate_metrics,
    checked_custom_advantage,
    compute_advantages,
    compute_loss,
    finalize_metrics,
    get_advantage_estimator,
    local_moments,
    masked_whiten,
    metric,
    reduction_counts_tokens,
    reduction_denominator,
    stack_metrics,
    unstack_metrics,
)
from miles.algo.advantages import AdvantageFn
from miles.backends.fsdp_utils.data_packing import (
    PackedBatch,
    dist_allreduce_max,
    pack_sequences,
    plan_micro_batches,
    plan_variable_micro_batches,
)
from miles.backends.fsdp_utils.parallel import ParallelState
from miles.config import AlgoConfig, Config
from miles.utils.misc import load_function
from miles.utils.types import Sample

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from miles.rollout.multimodal import MultimodalInputs


@dataclass
class RankBatch:
    """Per-sample tensors for the samples of this rank (B samples, L_i response tokens each)."""

    tokens: list[list[int]]  # B x [prompt + response]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]  # B x [L_i] float32
    rewards: torch.Tensor  # [B] float32
    group_ids: torch.Tensor  # [B] long
    rollout_log_probs: list[torch.Tensor] | None  # B x [L_i], None when the engine gave none
    old_log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None  # B x [L_i]: the critic's old values (--advantage-estimator ppo)
    advantages: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    # VLM: each sample's processed images (None: no image), from Sample.multimodal_data (vl_train.sample_images)
    images: list[MultimodalInputs | None] | None = None

    def pack_images(self, indices: list[int]) -> list[MultimodalInputs | None] | None:
        """The processed images of the samples `indices` (a pack's, in pack order); None without images."""
        return None if self.images is None else [self.images[i] for i in indices]

    @classmethod
    def from_samples(cls, samples: list[Sample], device: torch.device) -> RankBatch:
        """Tensors from this rank's `Sample` records (checked: token ids, loss mask and log-probs agree)."""
        if not samples:
            raise ValueError("this training rank received no samples")
        for s in samples:
            if not isinstance(s, Sample):
                raise ValueError(f"training batch: expected Sample records, got {type(s).__name__}")
            problem = s.check_consistent()
            if problem:
                raise ValueError(f"training batch: sample index {s.index}: {problem}")
        has_lp = all(s.rollout_log_probs is not None for s in samples)

        def mask(s: Sample) -> list[int]:
            return s.loss_mask if s.loss_mask is not None else [1] * s.response_length

        return cls(
            tokens=[list(s.tokens) for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[torch.tensor(mask(s), dtype=torch.float32, device=device) for s in samples],
            rewards=torch.tensor([s.scalar_reward() for s in samples], dtype=torch.float32, device=device),
            group_ids=torch.tensor([s.group_index for s in samples], dtype=torch.long, device=device),
            rollout_log_probs=(
                [torch.tensor(s.rollout_log_probs, dtype=torch.float32, device=device) for s in samples]
                if has_lp
                else None
            ),
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def require_rollout_log_probs(self) -> None:
        if self.rollout_log_probs is None:
            raise ValueError(
                "--use-rollout-logprobs: the rollout engine returned no log-probs for some samples"
            )

    def loss_inputs(
        self, indices: list[int], log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None
    ) -> LossInputs:
        def pick(values: list[torch.Tensor]) -> list[torch.Tensor]:
            return [values[i] for i in indices]

        def pick_given(values: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if values is None else pick(values)

        return LossInputs(
            log_probs=log_probs,
            old_log_probs=pick(computed(self.old_log_probs, "old_log_probs")),
            advantages=pick(computed(self.advantages, "advantages")),
            loss_masks=pick(self.loss_masks),
            ref_log_probs=pick_given(self.ref_log_probs),
            rollout_log_probs=pick_given(self.rollout_log_probs),
            entropy=entropy,
        )


def computed(values: list[torch.Tensor] | None, name: str) -> list[torch.Tensor]:
    """`values`, a `RankBatch` field that the trainer fills before it is read (old log-probs, advantages)."""
    assert values is not None, f"RankBatch.{name} is read before it is computed"
    return values


@dataclass
class Pack:
    """A micro-batch: the packed row and the RankBatch index of each of its sequences."""

    packed: PackedBatch
    indices: list[int]


def plan_steps(batch: RankBatch, cfg: Config, ps: ParallelState, steps_per_rollout: int) -> list[list[Pack]]:
    """Optimizer steps of `global_batch_size / dp` samples, each a list of packs (agreed across DP ranks); with
    `--use-session-server` the sample count varies (`plan_variable_micro_batches`: `steps_per_rollout` steps of
    whatever this rank got)."""
    t = cfg.train
    gbs = t.global_batch_size
    assert gbs is not None, "--global-batch-size is required (validation resolves it)"
    lengths = [len(x) for x in batch.tokens]
    allreduce_max = dist_allreduce_max(ps.dp_group) if ps.dp_size > 1 else None
    if cfg.rollout.use_session_server:
        plan = plan_variable_micro_batches(
            lengths,
            num_steps=steps_per_rollout,
            use_dynamic=t.use_dynamic_batch_size,
            max_tokens_per_gpu=t.max_tokens_per_gpu,
            micro_batch_size=t.micro_batch_size,
            cp_size=ps.cp_size,
            allreduce_max=allreduce_max,
        )
        return _packs(batch, plan)
    expected = steps_per_rollout * gbs // ps.dp_size
    if len(lengths) != expected:
        raise ValueError(
            f"DP rank {ps.dp_rank} got {len(lengths)} samples, expected {expected} "
            f"({steps_per_rollout} optimizer steps x --global-batch-size {gbs} / dp {ps.dp_size}); "
            "prompt groups must split evenly over DP ranks (--rollout-batch-size divisible by the DP size)"
        )
    plan = plan_micro_batches(
        lengths,
        global_batch_size=gbs,
        use_dynamic=t.use_dynamic_batch_size,
        max_tokens_per_gpu=t.max_tokens_per_gpu,
        micro_batch_size=t.micro_batch_size,
        dp_size=ps.dp_size,
        cp_size=ps.cp_size,
        allreduce_max=allreduce_max,
    )
    return _packs(batch, plan)


def _packs(batch: RankBatch, plan: list[list[list[int]]]) -> list[list[Pack]]:
    steps = []
    for step in plan:
        packs = []
        for mb in step:
            rows = [{"tokens": batch.tokens[i], "response_length": batch.response_lengths[i]} for i in mb]
            (packed,) = pack_sequences(rows, num_packs=1)
            packs.append(Pack(packed, [mb[j] for j in packed.sample_indices.tolist()]))
        steps.append(packs)
    return steps


def old_log_probs_from_training_forward(num_steps: int, cfg: Config, has_ref: bool) -> bool:
    """Whether the old log-probs can be read off the training forward instead of a separate no-grad pass.

    They can when that pass is provably equal to the training forward (same weights, same packs, same kernels)
    and nothing needs them before training starts:
    - this `train` call makes exactly one optimizer step (--global-batch-size = the whole rollout), so the
      weights do not move between the micro-batches and every micro-batch's forward runs on the rollout's
      weights, exactly as the separate pass would;
    - the advantages do not read them: no KL-in-reward penalty (--kl-coef 0 or no reference model) and no
      --custom-advantage-function-path (which receives them).
    Then each micro-batch's own log-probs, detached, are its old log-probs, so the first micro-batch's
    ppo_kl is 0 by construction (and every other micro-batch's too). TIS/MIS, --use-rollout-logprobs, the
    KL loss and custom losses see the same values the separate pass would give.
    """
    a = cfg.algo
    kl_in_reward = has_ref and a.kl_coef != 0
    return num_steps == 1 and not kl_in_reward and not a.custom_advantage_function_path


def _all_reduce_sum(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def compute_advantages_for(
    batch: RankBatch, a: AlgoConfig, custom_fn: AdvantageFn | None, dp_group: ProcessGroup | None
) -> None:
    """Fill `batch.advantages`/`returns` with `custom_fn` (``--custom-advantage-function-path``, resolved by
    `trainer_algo`) or the configured estimator. Group statistics stay within this rank's whole prompt groups."""
    log_probs = batch.old_log_probs
    inputs = AdvantageInputs(
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        loss_masks=batch.loss_masks,
        log_probs=log_probs,
        ref_log_probs=batch.ref_log_probs,
        kl_coef=a.kl_coef if batch.ref_log_probs is not None else 0.0,
        kl_type=a.kl_loss_type,
        gamma=a.gamma,
        lambd=a.lambd,
        values=batch.values,
        std_normalize=not a.disable_grpo_std_normalization,
    )
    if custom_fn is not None:
        out = custom_fn(inputs)
        whiten = a.normalize_advantages
    else:
        out = compute_advantages(a.advantage_estimator, inputs)
        whiten = a.normalize_advantages or get_advantage_estimator(a.advantage_estimator).whiten
    advantages = out.advantages
    if whiten:
        stats = _all_reduce_sum(local_moments(advantages, batch.loss_masks), dp_group)
        advantages = masked_whiten(advantages, batch.loss_masks, stats)
    batch.advantages = [x.float() for x in advantages]
    batch.returns = [x.float() for x in out.returns]


@dataclass(frozen=True)
class TrainerAlgo:
    """The algorithm as the trainer runs it, built once at trainer start by `trainer_algo`: the loss's records
    and the user functions, resolved from their paths."""

    loss: LossSettings
    loss_fn: LossFn  # compute_loss, or --custom-loss-function-path
    advantage_fn: (
        AdvantageFn | None
    )  # --custom-advantage-function-path (contract-checked); None: the estimator


def trainer_algo(cfg: Config) -> TrainerAlgo:
    """The one place the algorithm flags become records and the custom function paths become callables.

    The flags' rules (bounds, exclusions, derived values such as --loss-reduction-constant) were checked when
    the config was parsed; the records check their own invariants again only as plain values."""
    a = cfg.algo
    spec = PolicyLossSpec(
        name=a.policy_loss,
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        eps_clip_c=a.eps_clip_c,
        use_rollout_logprobs=a.use_rollout_logprobs,
        opsm=OPSM(delta=a.opsm_delta) if a.use_opsm else None,
    )
    settings = LossSettings(
        policy=spec,
        kl=KLPenalty(a.kl_loss_coef, a.kl_loss_type, a.use_unbiased_kl) if a.use_kl_loss else None,
        entropy_coef=a.entropy_coef,
        mismatch=_mismatch(a),
        reduction=loss_reduction(a),
    )
    loss_fn: LossFn = compute_loss
    if a.custom_loss_function_path:
        loss_fn = load_function(a.custom_loss_function_path, "--custom-loss-function-path")
    advantage_fn = None
    if a.custom_advantage_function_path:
        path = a.custom_advantage_function_path
        advantage_fn = checked_custom_advantage(load_function(path, "--custom-advantage-function-path"), path)
    return TrainerAlgo(loss=settings, loss_fn=loss_fn, advantage_fn=advantage_fn)


def _mismatch(a: AlgoConfig) -> Mismatch | None:
    """--custom-tis-function-path replaces --use-tis / --use-mis; both of those multiply."""
    if a.custom_tis_function_path:
        return CustomMismatch(load_function(a.custom_tis_function_path, "--custom-tis-function-path"))
    tis = TIS(lo=a.tis_clip_low, hi=a.tis_clip) if a.use_tis else None
    mis = MIS(level=a.mis_level, lo=a.mis_lower, hi=a.mis_upper) if a.use_mis else None
    if tis is not None and mis is not None:
        return TISAndMIS(tis, mis)
    return tis or mis


def loss_reduction(a: AlgoConfig) -> LossReduction:
    """The configured reduction (the actor's loss and the critic's value loss share it); its denominator is
    set per step by `step_reduction`."""
    return LossReduction(kind=a.loss_reduction, constant=a.loss_reduction_constant)


def step_reduction(
    reduction: LossReduction, batch: RankBatch, packs: list[Pack], ps: ParallelState, variable: bool = False
) -> LossReduction:
    """`reduction` with this optimizer step's denominator: global sample / loss-token counts over the DP group.

    FSDP averages gradients over the whole (dp x cp) mesh; CP ranks each hold cp x their share (the CP gather's
    backward sums), so the average equals the DP mean and only dp_size enters the denominator.

    The sample count needs no collective: every DP rank's step holds the same number of samples (`plan_steps`
    checks the rank's total, `plan_micro_batches` gives each step global_batch_size / dp of them). The loss-token
    count is all-reduced only for a reduction that reads it (`reduction_counts_tokens`: token_mean). With
    `variable` (--use-session-server: ranks' steps may hold different sample counts) the sample count is
    all-reduced too.
    """
    indices = [i for p in packs for i in p.indices]
    num_tokens = 0
    if reduction_counts_tokens(reduction.kind):
        local = float(sum(batch.loss_masks[i].sum() for i in indices))
        num_tokens = int(_all_reduce_sum(torch.tensor([local], dtype=torch.float64), ps.dp_group)[0])
    num_samples = len(indices) * ps.dp_size
    if variable:
        local_n = torch.tensor([float(len(indices))], dtype=torch.float64)
        num_samples = int(_all_reduce_sum(local_n, ps.dp_group)[0])
    denominator = reduction_denominator(
        reduction.kind,
        global_num_samples=num_samples,
        global_num_tokens=num_tokens,
        dp_size=ps.dp_size,
        constant=reduction.constant,
    )
    return dataclasses.replace(reduction, denominator=denominator)


def step_settings(
    settings: LossSettings, batch: RankBatch, packs: list[Pack], ps: ParallelState, variable: bool = False
) -> LossSettings:
    """`settings` with this optimizer step's reduction (`step_reduction`)."""
    reduction = step_reduction(settings.reduction, batch, packs, ps, variable)
    return dataclasses.replace(settings, reduction=reduction)


@dataclass
class MetricSum:
    """(numerator, count) metric pairs summed over micro-batches; reduced over the DP group at the end."""

    pairs: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        accumulate_metrics(self.pairs, {k: v.detach().cpu() for k, v in metrics.items()})

    def add_value(self, key: str, value: float) -> None:
        accumulate_metrics(self.pairs, {key: metric(value, 1.0)})

    def reduce(
        self,
        dp_group: ProcessGroup | None,
        batch: RankBatch | None = None,
        maxima: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """The metrics over the DP group, in ONE all-reduce with: `batch`'s advantages' mean and std over the DP
        group (loss tokens only: mask-0 positions are never read), and the largest over the DP group of each of
        this rank's `maxima` (returned under their own keys; each rank sums its values into its own slot of a
        [ranks, k] block, so the block after the sum holds every rank's values and its column maxima are exact)."""
        keys, stacked = stack_metrics(self.pairs)
        if batch is None:
            moments = stacked.new_zeros(0)
        else:
            moments = local_moments(computed(batch.advantages, "advantages"), batch.loss_masks)
        maxima = maxima or {}
        names = sorted(maxima)
        ranks, me = (
            (dist.get_world_size(dp_group), dist.get_rank(dp_group)) if dist.is_initialized() else (1, 0)
        )
        slots = torch.zeros(ranks, len(names), dtype=torch.float64)
        if names:
            slots[me] = torch.tensor([maxima[n] for n in names], dtype=torch.float64)
        flat = torch.cat(
            [stacked.reshape(-1).to(moments.device), moments.double(), slots.reshape(-1).to(moments.device)]
        )
        total = _all_reduce_sum(flat, dp_group).cpu()  # on the batch's device
        n_pairs, n_moments = stacked.numel(), moments.numel()
        stacked = total[:n_pairs].reshape(stacked.shape)
        out = {f"train/{k}": v for k, v in finalize_metrics(unstack_metrics(keys, stacked)).items()}
        if batch is not None:
            out.update(_advantage_stats(total[n_pairs : n_pairs + n_moments]))
        if names:
            peaks = total[n_pairs + n_moments :].reshape(ranks, len(names)).amax(dim=0)
            out.update(zip(names, peaks.tolist()))
        return out


def _advantage_stats(moments: torch.Tensor) -> dict[str, float]:
    """Mean and std of the advantages from their DP-reduced `local_moments` (sum, sum of squares, count)."""
    n = max(float(moments[2]), 1.0)
    mean = float(moments[0]) / n
    return {
        "train/advantage_mean": mean,
        "train/advantage_std": max(float(moments[1]) / n - mean * mean, 0.0) ** 0.5,
    }


def attach_values(batch: RankBatch, values: list[list[float]] | None) -> None:
    """The critic's values for this rank's samples (same order), checked against the loss masks."""
    if values is None:
        return
    if len(values) != len(batch):
        raise ValueError(f"critic sent values for {len(values)} samples, this rank has {len(batch)}")
    device = batch.rewards.device
    batch.values = [torch.tensor(v, dtype=torch.float32, device=device) for v in values]
    for i, (v, m) in enumerate(zip(batch.values, batch.loss_masks)):
        if v.shape != m.shape:
            raise ValueError(
                f"critic values of sample {i} have shape {tuple(v.shape)}, its loss mask {tuple(m.shape)}"
            )
