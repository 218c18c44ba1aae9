"""Exact sequence packing for the FSDP trainer.

Samples are concatenated into one row per pack with boundaries in `cu_seqlens`; attention is block-diagonal
causal over those boundaries (see packed_attention.py), so no pad tokens are computed. Everything that maps values
back to samples uses `cu_seqlens` and the recorded prompt/response lengths, never token values (a response
may legitimately end in, or consist only of, token id 0).

Token layouts used below:
- pack row, length T = sum of sample lengths: `tokens`, `position_ids`;
- response tokens, length R = sum of response lengths, sample after sample: `loss_masks`, `advantages`, ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles.utils.seqlen_balancing import (
    check_lengths_fit,
    get_minimum_num_micro_batch_size,
    partition_to_packs,
)
from miles.utils.types import Sample

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

__all__ = [
    "PER_TOKEN_FIELDS",
    "PackedBatch",
    "dist_allreduce_max",
    "pack_sequences",
    "plan_micro_batches",
    "unpack_sequences",
]

# sample key -> PackedBatch attribute, for optional per-response-token float fields
PER_TOKEN_FIELDS: dict[str, str] = {
    "advantages": "advantages",
    "returns": "returns",
    "rollout_log_probs": "rollout_log_probs",
    "old_log_probs": "old_log_probs",
    "ref_log_probs": "ref_log_probs",
}


@dataclass
class PackedBatch:
    """One pack: n sequences concatenated into a row of T tokens, with R response tokens in total."""

    tokens: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [n+1] int32, sequence i is tokens[cu_seqlens[i]:cu_seqlens[i+1]]
    sample_indices: torch.Tensor  # [n] long, position of each sequence in the list given to pack_sequences
    prompt_lengths: torch.Tensor  # [n] long, >= 1
    response_lengths: torch.Tensor  # [n] long
    loss_masks: torch.Tensor  # [R] float32 (all ones when samples carry no loss_mask)
    advantages: torch.Tensor | None = None  # [R] float32
    returns: torch.Tensor | None = None  # [R] float32
    rollout_log_probs: torch.Tensor | None = None  # [R] float32
    old_log_probs: torch.Tensor | None = None  # [R] float32
    ref_log_probs: torch.Tensor | None = None  # [R] float32
    rewards: torch.Tensor | None = None  # [n] float32

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.sample_indices.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_lengths.sum())

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max()) if self.num_sequences else 0

    @property
    def response_cu_seqlens(self) -> torch.Tensor:
        """[n+1] long: sample i's response tokens are [r[i], r[i+1]) in the response-token layout."""
        return torch.cat([self.response_lengths.new_zeros(1), self.response_lengths.cumsum(0)])

    def response_token_positions(self) -> torch.Tensor:
        """[R] long: row positions of the response tokens (sequence start + prompt length + j)."""
        # response token j of sequence i sits at start_i + j = (start_i - r_i) + (its index in the R layout), with
        # r_i the offset of sequence i's response in that layout
        starts = self.cu_seqlens[:-1].long() + self.prompt_lengths
        shift = torch.repeat_interleave(starts - self.response_cu_seqlens[:-1], self.response_lengths)
        return shift + torch.arange(shift.numel())

    def logit_positions(self) -> torch.Tensor:
        """[R] long: row positions whose logits predict each response token (one before it, same sequence)."""
        return self.response_token_positions() - 1


def _as_list(value: object, name: str, index: int) -> list[float]:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    if isinstance(value, Sequence):
        return list(value)
    raise ValueError(f"sample {index}: {name} must be a list or a 1-D tensor, got {type(value).__name__}")


def _sample_view(sample: object, index: int) -> Mapping[str, object]:
    if isinstance(sample, Mapping):
        return sample
    if isinstance(sample, Sample):
        return sample.to_dict()
    raise ValueError(f"sample {index} must be a dict (or a Sample), got {type(sample).__name__}")


def _validated(samples: Sequence[object]) -> list[dict[str, Any]]:
    """Check each sample's lengths and per-token fields; return normalised dicts with plain lists."""
    out = []
    for i, raw in enumerate(samples):
        s = _sample_view(raw, i)
        if "tokens" not in s or "response_length" not in s:
            raise ValueError(f"sample {i} needs 'tokens' and 'response_length'; got keys {sorted(s)}")
        tokens = _as_list(s["tokens"], "tokens", i)
        length = s["response_length"]
        if not isinstance(length, int | float | torch.Tensor) or isinstance(length, bool):
            raise ValueError(f"sample {i}: response_length must be an integer, got {type(length).__name__}")
        resp = int(length)
        if not 0 <= resp < len(tokens):
            raise ValueError(
                f"sample {i}: response_length={resp} with {len(tokens)} tokens; allowed 0 <= response_length "
                "< len(tokens) (at least one prompt token is needed to predict the first response token)"
            )
        norm: dict[str, Any] = {"tokens": tokens, "response_length": resp}
        for key in ("loss_mask", *PER_TOKEN_FIELDS):
            if s.get(key) is not None:
                values = _as_list(s[key], key, i)
                if len(values) != resp:
                    raise ValueError(f"sample {i}: {key} has {len(values)} values, response_length is {resp}")
                norm[key] = values
        reward = s.get("reward")
        if reward is not None and not isinstance(reward, (int, float)):
            raise ValueError(f"sample {i}: reward must be a number to pack, got {type(reward).__name__}")
        norm["reward"] = reward
        out.append(norm)
    for key in (*PER_TOKEN_FIELDS, "reward"):
        present = [key in s and s[key] is not None for s in out]
        if any(present) and not all(present):
            missing = [i for i, p in enumerate(present) if not p]
            raise ValueError(f"{key} is given for some samples but missing for samples {missing[:10]}")
    return out


def _build_pack(samples: list[dict[str, Any]], indices: Sequence[int]) -> PackedBatch:
    chosen = [samples[i] for i in indices]
    lengths = [len(s["tokens"]) for s in chosen]
    resp = [s["response_length"] for s in chosen]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)

    def flat(key: str) -> torch.Tensor:
        return torch.tensor([v for s in chosen for v in s[key]], dtype=torch.float32)

    extras = {
        attr: flat(key) if chosen and key in chosen[0] else None for key, attr in PER_TOKEN_FIELDS.items()
    }
    loss_masks = torch.tensor(
        [v for s in chosen for v in (s.get("loss_mask") or [1] * s["response_length"])], dtype=torch.float32
    )
    rewards = None
    if chosen and chosen[0]["reward"] is not None:
        rewards = torch.tensor([float(s["reward"]) for s in chosen], dtype=torch.float32)
    return PackedBatch(
        tokens=torch.tensor([t for s in chosen for t in s["tokens"]], dtype=torch.long),
        position_ids=torch.cat([torch.arange(n) for n in lengths])
        if lengths
        else torch.zeros(0, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        sample_indices=torch.tensor(list(indices), dtype=torch.long),
        prompt_lengths=torch.tensor([n - r for n, r in zip(lengths, resp)], dtype=torch.long),
        response_lengths=torch.tensor(resp, dtype=torch.long),
        loss_masks=loss_masks,
        rewards=rewards,
        **extras,
    )


def pack_sequences(
    samples: Sequence[Mapping[str, object] | Sample],
    num_packs: int | None = None,
    max_tokens_per_pack: int | None = None,
) -> list[PackedBatch]:
    """Pack samples into rows balanced by token count, none longer than `max_tokens_per_pack`.

    Each sample is a dict (or a `Sample`) with `tokens` (prompt + response ids), `response_length`, and
    optionally per-response-token `loss_mask` (defaults to ones), `advantages`, `returns`,
    `rollout_log_probs`, `old_log_probs`, `ref_log_probs` (lists or 1-D tensors) and a scalar `reward`.
    Other keys are ignored. An optional field must be given for all samples or for none.

    The number of packs is `num_packs` when given, otherwise the minimum first-fit decreasing needs under
    `max_tokens_per_pack`. Packs are balanced with Karmarkar-Karp; if a balanced split would overflow the
    cap it is repaired (see `partition_to_packs`): exactly `num_packs` come back when `num_packs` is at least
    that minimum, more when fewer were asked for than fit. No pack ever exceeds `max_tokens_per_pack`.
    Within a pack, sequences keep their input order; `sample_indices` maps them back.

    Raises ValueError when neither option is given, when `num_packs` exceeds the number of samples (a pack
    would be empty), when a single sample is longer than the cap, or for malformed samples.
    """
    if num_packs is None and max_tokens_per_pack is None:
        raise ValueError("pack_sequences needs num_packs or max_tokens_per_pack (or both); got neither")
    normalised = _validated(samples)
    if not normalised:
        if num_packs:
            raise ValueError(f"num_packs={num_packs} but there are no samples to pack")
        return []
    lengths = [len(s["tokens"]) for s in normalised]
    if max_tokens_per_pack is not None:
        check_lengths_fit(lengths, max_tokens_per_pack, "max_tokens_per_pack")
    if num_packs is None:
        assert max_tokens_per_pack is not None
        num_packs = get_minimum_num_micro_batch_size(lengths, max_tokens_per_pack)
    if num_packs == 1 and (max_tokens_per_pack is None or sum(lengths) <= max_tokens_per_pack):
        parts = [list(range(len(lengths)))]  # what partition_to_packs gives for one pack, without balancing
    else:
        parts = partition_to_packs(lengths, num_packs, max_tokens_per_pack)
    return [_build_pack(normalised, part) for part in parts]


def unpack_sequences(per_token_values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Split a pack's values into one `[response_length_i, ...]` tensor per sequence (views, differentiable).

    `per_token_values` has leading size T (aligned with `packed.tokens`: the response of sequence i is rows
    `cu_seqlens[i] + prompt_length_i` to `cu_seqlens[i+1]`) or R (response-token layout, as `loss_masks` and
    what `forward_packed` computes). Boundaries come from `cu_seqlens` and the recorded lengths only.
    Since every prompt has at least one token, T > R whenever the pack is non-empty, so the layout is
    unambiguous. Raises ValueError for any other leading size.
    """
    size = per_token_values.shape[0] if per_token_values.dim() else -1
    t, r = packed.num_tokens, packed.num_response_tokens
    resp = packed.response_lengths.tolist()
    if size == r:
        return list(torch.split(per_token_values, resp, dim=0))
    if size == t:
        starts = (packed.cu_seqlens[:-1].long() + packed.prompt_lengths).tolist()
        return [per_token_values[s : s + n] for s, n in zip(starts, resp)]
    raise ValueError(
        f"per_token_values has leading size {size}; allowed: {t} (pack tokens) or {r} (response tokens)"
    )


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    global_batch_size: int,
    use_dynamic: bool,
    max_tokens_per_gpu: int | None,
    micro_batch_size: int | None,
    dp_size: int,
    cp_size: int = 1,
    allreduce_max: Callable[[int], int] | None = None,
) -> list[list[list[int]]]:
    """Split this DP rank's samples into optimizer steps and each step into micro-batches.

    `lengths` are this rank's sample lengths in order; each optimizer step takes the next
    `global_batch_size // dp_size` of them. Returns `plan[step][micro_batch] = [local sample indices]`.

    - dynamic (`use_dynamic`): per step, the minimum number of micro-batches that fit
      `max_tokens_per_gpu * cp_size` tokens each (a pack is split over cp_size ranks), agreed across DP ranks
      by `allreduce_max` (every rank must do the same number of forward/backward passes), then filled with
      balanced packs (`partition_to_packs`), none over the cap. A sample longer than the cap is a micro-batch
      of its own (logged; the reference's behaviour), the rest are planned as if it were not there; when every
      sample fits, the plan is the one without that rule. `allreduce_max` is called once per step, in
      order, on every rank; it is required when `dp_size > 1` (see `dist_allreduce_max`).
    - static: `global_batch_size // (micro_batch_size * dp_size)` micro-batches of `micro_batch_size`
      consecutive samples per step.

    Raises ValueError naming the offending value when sizes do not divide, a needed option is missing, or the
    agreed count exceeds a step's samples on this rank (sample counts per rank differ;
    `partition_samples_by_dp` gives equal counts when the batch divides evenly).
    """
    if dp_size < 1 or cp_size < 1:
        raise ValueError(f"dp_size and cp_size must be >= 1, got dp_size={dp_size}, cp_size={cp_size}")
    if global_batch_size < 1 or global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of dp_size={dp_size}"
        )
    per_rank = global_batch_size // dp_size
    if len(lengths) % per_rank:
        raise ValueError(
            f"this rank has {len(lengths)} samples, not a multiple of global_batch_size // dp_size = {per_rank}"
        )
    steps = [list(range(s, s + per_rank)) for s in range(0, len(lengths), per_rank)]

    if not use_dynamic:
        if micro_batch_size is None or micro_batch_size < 1 or per_rank % micro_batch_size:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} must be >= 1 and divide global_batch_size // dp_size = "
                f"{per_rank} (global_batch_size={global_batch_size}, dp_size={dp_size})"
            )
        num = global_batch_size // (micro_batch_size * dp_size)
        return [
            [step[m * micro_batch_size : (m + 1) * micro_batch_size] for m in range(num)] for step in steps
        ]

    if max_tokens_per_gpu is None or max_tokens_per_gpu < 1:
        raise ValueError(f"use_dynamic needs max_tokens_per_gpu >= 1, got {max_tokens_per_gpu}")
    if dp_size > 1 and allreduce_max is None:
        raise ValueError(f"dp_size={dp_size} > 1 needs allreduce_max so DP ranks agree on micro-batch counts")
    cap = max_tokens_per_gpu * cp_size
    return [_plan_dynamic_step(step, lengths, cap, allreduce_max) for step in steps]


def _plan_dynamic_step(
    step: list[int], lengths: Sequence[int], cap: int, allreduce_max: Callable[[int], int] | None
) -> list[list[int]]:
    """One optimizer step's micro-batches under `cap` tokens each (see `plan_micro_batches`, dynamic)."""
    # A sample longer than the cap gets a micro-batch of its own (as the reference does); the others are
    # packed under the cap exactly as when every sample fits.
    alone = [i for i in step if lengths[i] > cap]
    packed = [i for i in step if lengths[i] <= cap]
    if alone:
        logger.warning(
            "%d sample(s) of %s tokens exceed --max-tokens-per-gpu * context-parallel size = %d: each "
            "is a micro-batch of its own (peak memory grows with it)",
            len(alone),
            sorted(lengths[i] for i in alone),
            cap,
        )
    packed_lengths = [lengths[i] for i in packed]
    local = get_minimum_num_micro_batch_size(packed_lengths, cap) + len(alone)
    agreed = allreduce_max(local) if allreduce_max is not None else local
    if agreed > len(step):
        raise ValueError(
            f"DP ranks agreed on {agreed} micro-batches but this rank has only {len(step)} samples in the step"
        )
    parts = partition_to_packs(packed_lengths, agreed - len(alone), cap) if packed else []
    micro_batches = [[packed[i] for i in part] for part in parts] + [[i] for i in alone]
    return sorted(micro_batches, key=lambda mb: mb[0]) if alone else micro_batches


def _chunks(items: list[int], n: int) -> list[list[int]]:
    """`items` cut into `n` contiguous chunks whose sizes differ by at most one (larger first)."""
    q, r = divmod(len(items), n)
    cuts = [0]
    for k in range(n):
        cuts.append(cuts[-1] + q + (k < r))
    return [items[a:b] for a, b in zip(cuts, cuts[1:])]


def plan_variable_micro_batches(
    lengths: Sequence[int],
    *,
    num_steps: int,
    use_dynamic: bool,
    max_tokens_per_gpu: int | None,
    micro_batch_size: int | None,
    cp_size: int = 1,
    allreduce_max: Callable[[int], int] | None = None,
) -> list[list[list[int]]]:
    """`plan_micro_batches` for a rollout whose sample count is not fixed (agent sessions: a group holds every
    picked leaf) and may differ between DP ranks: this rank's samples are cut into `num_steps` contiguous
    optimizer steps of near-equal size (the step trains on what it got; `--global-batch-size` only fixed
    `num_steps`); each step's micro-batch count is agreed across DP ranks by `allreduce_max` (called twice per
    step static, once dynamic, in order on every rank) and the step is split into that many. Static: the
    largest need, ceil(samples / `micro_batch_size`), capped by the smallest rank's step size (every micro-batch
    holds a sample, so a micro-batch may then exceed `micro_batch_size`), in contiguous chunks of near-equal
    size. Dynamic: as `plan_micro_batches` (ValueError when a rank has fewer samples than the agreed count).
    ValueError when this rank has fewer samples than `num_steps`."""
    if num_steps < 1 or len(lengths) < num_steps:
        raise ValueError(
            f"{len(lengths)} samples on this rank cannot fill num_steps={num_steps} optimizer steps"
        )
    steps = _chunks(list(range(len(lengths))), num_steps)
    if use_dynamic:
        if max_tokens_per_gpu is None or max_tokens_per_gpu < 1:
            raise ValueError(f"use_dynamic needs max_tokens_per_gpu >= 1, got {max_tokens_per_gpu}")
        return [
            _plan_dynamic_step(step, lengths, max_tokens_per_gpu * cp_size, allreduce_max) for step in steps
        ]
    if micro_batch_size is None or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    plan = []
    for step in steps:
        need = -(-len(step) // micro_batch_size)
        if allreduce_max is not None:  # no rank can run more micro-batches than it has samples
            need = min(allreduce_max(need), -allreduce_max(-len(step)))
        plan.append(_chunks(step, need))
    return plan


def dist_allreduce_max(group: ProcessGroup | None = None) -> Callable[[int], int]:
    """An `allreduce_max` for `plan_micro_batches` over a torch.distributed process group (default: world).

    Uses a CPU tensor for gloo groups and a tensor on the current CUDA device otherwise (NCCL).
    """
    import torch.distributed as dist

    def allreduce_max(value: int) -> int:
        backend = dist.get_backend(group)
        device = (
            torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        )
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    return allreduce_max
