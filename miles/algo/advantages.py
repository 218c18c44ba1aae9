"""Advantage estimators: per-sample scalar rewards (+ optional KL penalty) -> per-token advantages.

Every estimator is a function ``fn(inputs: AdvantageInputs) -> AdvantageOutputs`` registered by name with
``@register_advantage(name)``; ``compute_advantages(name, inputs)`` dispatches through the registry. Outputs are
per sample, aligned with ``loss_masks`` (one tensor of length L_i per sample). Values at positions with
loss mask 0 carry no meaning; the loss ignores them (it selects with the mask, so even nan/inf there is
harmless), and so do the KL penalty and the whitening here.

Batch-level whitening (reinforce_plus_plus*, and ``--normalize-advantages`` for any estimator) needs statistics
over the whole data-parallel batch, which this package cannot collect (no collectives here). The backend does:

    stats = local_moments(advantages, loss_masks)       # Tensor[3] (sum, sum_sq, count), float64
    all_reduce(stats, SUM) over the DP group
    advantages = masked_whiten(advantages, loss_masks, stats)

``get_advantage_estimator(name).whiten`` says whether an estimator expects that step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.algo import _ops
from miles.algo.kl import KL_TYPES, compute_approx_kl
from miles.algo.registry import Registry


@dataclass
class AdvantageInputs:
    """Everything an estimator may use, for B samples (all prompts' samples of one rollout, or a DP shard
    holding whole prompt groups: group statistics are taken only over the samples passed in)."""

    rewards: Tensor  # [B] float: one scalar reward per sample
    group_ids: Tensor  # [B] long: samples generated from the same prompt share an id
    loss_masks: list[Tensor]  # B x [L_i]: 1 for response tokens trained on, 0 otherwise
    log_probs: list[Tensor] | None = None  # B x [L_i]: policy (old / rollout) log-probs; for the KL penalty
    ref_log_probs: list[Tensor] | None = None  # B x [L_i]: reference-model log-probs; for the KL penalty
    kl_coef: float = 0.0  # weight of the per-token KL penalty in the reward (reinforce_plus_plus*)
    kl_type: str = "k1"  # KL estimator for that penalty, see miles.algo.kl
    gamma: float = 1.0  # discount per loss token (reinforce_plus_plus*, ppo)
    lambd: float = 1.0  # GAE lambda (ppo)
    values: list[Tensor] | None = None  # B x [L_i]: critic values V(s_t) at each response token (ppo)
    std_normalize: bool = True  # grpo/gspo: divide by the group std (False: Dr.GRPO, mean-centring only)
    eps: float = 1e-6  # added to the group std before dividing

    def __post_init__(self) -> None:
        if self.rewards.dim() != 1:
            raise ValueError(f"rewards must be 1-D [B], got shape {tuple(self.rewards.shape)}")
        if self.group_ids.shape != self.rewards.shape:
            raise ValueError(
                f"group_ids shape {tuple(self.group_ids.shape)} != rewards shape {tuple(self.rewards.shape)}"
            )
        if self.group_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"group_ids must be an integer tensor, got dtype {self.group_ids.dtype}")
        if len(self.loss_masks) != self.rewards.numel():
            raise ValueError(f"{len(self.loss_masks)} loss_masks for {self.rewards.numel()} rewards")
        for name in ("log_probs", "ref_log_probs", "values"):
            values = getattr(self, name)
            if values is not None:
                _ops.check_aligned(name, values, self.loss_masks)
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type={self.kl_type!r}; choose one of {list(KL_TYPES)}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma={self.gamma} must be in [0, 1]")
        if not 0.0 <= self.lambd <= 1.0:
            raise ValueError(f"lambd={self.lambd} must be in [0, 1]")
        if self.eps < 0:
            raise ValueError(f"eps={self.eps} must be >= 0")

    @property
    def response_lengths(self) -> list[int]:
        """L_i per sample (the length of each loss mask)."""
        return _ops.lengths_of(self.loss_masks)


@dataclass
class AdvantageOutputs:
    advantages: list[Tensor]  # B x [L_i] float32
    returns: list[Tensor]  # B x [L_i] float32 (the un-normalised target; equal to advantages for grpo/rloo)


AdvantageFn = Callable[[AdvantageInputs], AdvantageOutputs]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: AdvantageFn
    whiten: bool  # the estimator's advantages are meant to be whitened over the DP batch afterwards


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage(name: str, *, whiten: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an estimator ``fn(inputs: AdvantageInputs) -> AdvantageOutputs`` under `name`.

    `whiten=True` records that its advantages must be whitened over the DP batch (see the module docstring).
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(name=name, fn=fn, whiten=whiten))
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator `name` (ValueError listing the choices on a miss)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def checked_custom_advantage(fn: AdvantageFn, name: str) -> AdvantageFn:
    """A user advantage function (``--custom-advantage-function-path``, resolved by the trainer; `name` is its
    path, for errors) wrapped to check its contract: ``fn(inputs: AdvantageInputs) -> AdvantageOutputs`` with
    one tensor of length L_i per sample in both fields.
    """

    def checked(inputs: AdvantageInputs) -> AdvantageOutputs:
        out = fn(inputs)
        if not isinstance(out, AdvantageOutputs):
            raise ValueError(
                f"custom advantage function {name!r} returned {type(out).__name__}, expected AdvantageOutputs"
            )
        _ops.check_aligned(f"{name} advantages", out.advantages, inputs.loss_masks)
        _ops.check_aligned(f"{name} returns", out.returns, inputs.loss_masks)
        return out

    return checked


def compute_advantages(name: str, inputs: AdvantageInputs) -> AdvantageOutputs:
    """Run the registered estimator `name` on `inputs` (no batch whitening; see the module docstring)."""
    return get_advantage_estimator(name).fn(inputs)


# ----------------------------------------------------------------------------------------------- group stats


def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(inverse [B]: dense group index per sample, counts [G]: samples per group)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


@dataclass
class _GroupStats:
    """Per-sample float64 statistics of each sample's prompt group."""

    mean: Tensor  # [B] group mean; exactly the reward itself when every reward of the group is equal
    std: Tensor  # [B] unbiased (n - 1) group std; exactly 0 for equal rewards and for groups of one
    size: Tensor  # [B] long: samples in the group


def _group_stats(rewards: Tensor, group_ids: Tensor) -> _GroupStats:
    """Group statistics in float64, two-pass (mean, then centred squares).

    A group whose rewards are all equal gets mean == reward exactly, so r - mean is exactly 0 even when the
    value is not exact in binary (eight samples rewarded 5.3: a computed mean can differ from 5.3 in the last
    bit, and dividing that residue by std + eps would give a nonzero advantage)."""
    r = rewards.double()
    inverse, counts = _group_index(group_ids)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add(0, inverse, r)
    group_max = torch.full((num_groups,), -torch.inf, dtype=r.dtype, device=r.device)
    group_max = group_max.scatter_reduce(0, inverse, r, reduce="amax")
    group_min = torch.full((num_groups,), torch.inf, dtype=r.dtype, device=r.device)
    group_min = group_min.scatter_reduce(0, inverse, r, reduce="amin")
    equal = (group_max == group_min)[inverse]
    mean = torch.where(equal, r, (sums / counts.to(r.dtype))[inverse])
    sq = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add(0, inverse, (r - mean).square())
    var = sq / (counts.to(r.dtype) - 1).clamp(min=1)
    return _GroupStats(mean=mean, std=var.sqrt()[inverse], size=counts[inverse])


def group_mean(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Tensor[B]: the mean reward of each sample's prompt group (computed in float64, returned as float32;
    exactly the common value for a group whose rewards are all equal)."""
    return _group_stats(rewards, group_ids).mean.float()


def group_std(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Tensor[B]: the UNBIASED (Bessel-corrected, divide by n-1) std of each sample's group, computed in
    float64 and returned as float32; 0 for groups of size 1 (where the unbiased std is undefined) and exactly 0
    for groups whose rewards are all equal."""
    return _group_stats(rewards, group_ids).std.float()


def _broadcast(values: Tensor, loss_masks: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Each sample's scalar repeated over its response tokens, float32, twice (advantages and returns: two
    buffers, so one can be changed in place without the other): one repeat for all samples, split into views."""
    lengths = _ops.lengths_of(loss_masks)
    device = loss_masks[0].device if loss_masks else values.device
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    flat = values.to(device=device, dtype=torch.float32).repeat_interleave(counts)
    return _ops.split(flat, lengths), _ops.split(flat.clone(), lengths)


# ----------------------------------------------------------------------------------------------- estimators


@register_advantage("grpo")
def grpo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), statistics over sample i's prompt group g ONLY (never over
    the batch). std_g is the unbiased (n-1) group std. ``std_normalize=False`` gives Dr.GRPO: A_i = r_i - mean_g.
    A sample alone in its group gets advantage 0 (there is nothing to compare it with), and so does every
    sample of a group whose rewards are all equal, exactly. Statistics are taken in float64. The scalar is
    broadcast to every token of the response; returns == advantages."""
    stats = _group_stats(inputs.rewards, inputs.group_ids)
    adv = inputs.rewards.double() - stats.mean
    if inputs.std_normalize:
        adv = adv / (stats.std + inputs.eps)
    adv = torch.where(stats.size > 1, adv, torch.zeros_like(adv))
    advantages, returns = _broadcast(adv, inputs.loss_masks)
    return AdvantageOutputs(advantages=advantages, returns=returns)


@register_advantage("gspo")
def gspo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GSPO uses GRPO's group-normalised advantages unchanged (only its policy loss differs)."""
    return grpo_advantages(inputs)


@register_advantage("rloo")
def rloo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """RLOO: A_i = r_i - mean_{j != i, j in group(i)} r_j  (= n/(n-1) * (r_i - mean_g)); 0 for groups of size 1
    and, exactly, for groups whose rewards are all equal (float64 statistics). Broadcast to every response
    token; returns == advantages."""
    stats = _group_stats(inputs.rewards, inputs.group_ids)
    n = stats.size.double()
    centred = inputs.rewards.double() - stats.mean
    adv = torch.where(n > 1, centred * n / (n - 1).clamp(min=1), torch.zeros_like(centred))
    advantages, returns = _broadcast(adv, inputs.loss_masks)
    return AdvantageOutputs(advantages=advantages, returns=returns)


def _token_kl(inputs: AdvantageInputs) -> list[Tensor]:
    if inputs.kl_coef == 0.0:
        return [torch.zeros(m.shape, dtype=torch.float32, device=m.device) for m in inputs.loss_masks]
    if inputs.log_probs is None or inputs.ref_log_probs is None:
        raise ValueError(f"kl_coef={inputs.kl_coef} needs log_probs and ref_log_probs (got None)")
    return [
        compute_approx_kl(lp.detach(), ref.detach(), inputs.kl_type)
        for lp, ref in zip(inputs.log_probs, inputs.ref_log_probs)
    ]


def discounted_returns(token_rewards: Tensor, loss_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over the loss tokens of one sample, walking backwards; positions with mask 0
    are skipped (they get G = 0 and do not consume a discount step)."""
    values = token_rewards.detach().double().tolist()
    mask = loss_mask.bool().tolist()
    returns = [0.0] * len(values)
    running = 0.0
    for t in range(len(values) - 1, -1, -1):
        if mask[t]:
            running = values[t] + gamma * running
            returns[t] = running
    return torch.tensor(returns, dtype=torch.float32, device=token_rewards.device)


def _reinforce_returns(inputs: AdvantageInputs, rewards: Tensor) -> AdvantageOutputs:
    kls = _token_kl(inputs)
    returns = []
    for reward, kl, mask in zip(rewards.tolist(), kls, inputs.loss_masks):
        token_rewards = -inputs.kl_coef * _ops.masked(kl, mask.float())
        positions = torch.nonzero(mask.bool()).flatten()
        if positions.numel() > 0:
            token_rewards[positions[-1]] += reward
        returns.append(discounted_returns(token_rewards, mask, inputs.gamma))
    return AdvantageOutputs(advantages=[r.clone() for r in returns], returns=returns)


@register_advantage("reinforce_plus_plus", whiten=True)
def reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++: token reward r_t = -kl_coef * kl_t on every loss token, plus the scalar reward on the LAST
    loss token (the last response token whose mask is 1); advantages = returns = discounted returns with
    `gamma` (masked positions skipped, see `discounted_returns`). Whitening over the DP batch is left to the
    backend (`whiten=True`)."""
    return _reinforce_returns(inputs, inputs.rewards.float())


@register_advantage("reinforce_plus_plus_baseline", whiten=True)
def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++ with a group baseline: as reinforce_plus_plus on r_i - mean_g (the group-mean reward is
    subtracted first, in float64; a sample alone in its group, or in a group of equal rewards, thus gets reward
    exactly 0). Whitened afterwards by the backend."""
    stats = _group_stats(inputs.rewards, inputs.group_ids)
    return _reinforce_returns(inputs, (inputs.rewards.double() - stats.mean).float())


def gae(
    token_rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float, lambd: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the loss tokens of ONE sample: (advantages, returns), [L] float32.

    Only mask-1 positions are steps of the episode (multi-turn: tool/observation tokens with mask 0 are not
    actions, so they neither get a value target nor consume a discount step). With k_1 < ... < k_n the loss
    positions, V_{n+1} = 0 (the episode ends after the last loss token):
        delta_j = r_{k_j} + gamma * V_{k_{j+1}} - V_{k_j}
        A_{k_j} = delta_j + gamma * lambd * A_{k_{j+1}},    returns = A + V.
    Mask-0 positions get 0 in both outputs. Computed in float64, backwards over the compressed positions."""
    positions = torch.nonzero(loss_mask.bool()).flatten()
    adv = torch.zeros(loss_mask.shape, dtype=torch.float64, device=loss_mask.device)
    ret = torch.zeros_like(adv)
    if positions.numel() == 0:
        return adv.float(), ret.float()
    v = values.detach().double().index_select(0, positions)
    r = token_rewards.detach().double().index_select(0, positions)
    next_v = torch.cat([v[1:], v.new_zeros(1)])
    deltas = (r + gamma * next_v - v).tolist()
    out = [0.0] * len(deltas)
    running, factor = 0.0, gamma * lambd
    for j in range(len(deltas) - 1, -1, -1):
        running = deltas[j] + factor * running
        out[j] = running
    a = torch.tensor(out, dtype=torch.float64, device=loss_mask.device)
    adv[positions] = a
    ret[positions] = a + v
    return adv.float(), ret.float()


@register_advantage("ppo", whiten=True)
def ppo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """PPO with a learned critic: GAE (`gae`) with `gamma` and `lambd` over the critic `values`. The token reward
    is -kl_coef * kl_t on every loss token plus the scalar reward on the LAST loss token (as reinforce_plus_plus).
    `returns` (A + V) are the critic's regression targets; advantages are whitened over the DP batch afterwards
    by the backend (`whiten=True`). Raises ValueError without `values`."""
    if inputs.values is None:
        raise ValueError("advantage estimator 'ppo' needs critic values (AdvantageInputs.values is None)")
    kls = _token_kl(inputs)
    advantages, returns = [], []
    for reward, kl, mask, values in zip(inputs.rewards.tolist(), kls, inputs.loss_masks, inputs.values):
        token_rewards = -inputs.kl_coef * _ops.masked(kl, mask.float())
        positions = torch.nonzero(mask.bool()).flatten()
        if positions.numel() > 0:
            token_rewards[positions[-1]] += reward
        a, r = gae(token_rewards, values, mask, inputs.gamma, inputs.lambd)
        advantages.append(a)
        returns.append(r)
    return AdvantageOutputs(advantages=advantages, returns=returns)


# -------------------------------------------------------------------------------------- batch whitening


def local_moments(values: list[Tensor], masks: list[Tensor]) -> Tensor:
    """Tensor[3] float64 = (sum, sum of squares, count) of `values` over mask==1 tokens of this rank.

    All-reduce (SUM) it over the DP group and pass it to `masked_whiten`.
    """
    _ops.check_aligned("values", values, masks)
    mask = _ops.cat(masks).double()
    flat = _ops.masked(_ops.cat(values).detach().double(), mask)
    return torch.stack([flat.sum(), _ops.masked(flat.square(), mask).sum(), mask.sum()])


def masked_whiten(
    values: list[Tensor], masks: list[Tensor], stats: Tensor, eps: float = 1e-8
) -> list[Tensor]:
    """(v - mean) / sqrt(var + eps) with mean and the BIASED (population, divide by count) variance from the
    global `stats` = (sum, sum_sq, count), e.g. all-reduced `local_moments`. Positions with mask 0 are set to
    0 (whatever they held). Raises ValueError if the count is 0."""
    _ops.check_aligned("values", values, masks)
    if stats.shape != (3,):
        raise ValueError(f"stats must be Tensor[3] (sum, sum_sq, count), got shape {tuple(stats.shape)}")
    total, total_sq, count = (float(x) for x in stats.double())
    if count <= 0:
        raise ValueError(f"cannot whiten over {count} loss tokens")
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    scale = (var + eps) ** -0.5
    return [_ops.masked((v.float() - mean) * scale, m.float()) for v, m in zip(values, masks)]
