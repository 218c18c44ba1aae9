"""Mixture-of-experts routing in the trainer: capture, replay (R3 and routing replay), auxiliary losses, metrics.

The HF MoE blocks are not forked: `moe_routing` installs a forward hook on every router module (transformers'
`Qwen3MoeTopKRouter`, which returns `(router_logits, top-k gate weights, top-k expert ids)`) for the duration of
one forward. The hook records each layer's logits and the experts used, and with a replay tensor it replaces the
router's top-k choice by the replayed experts: the gate weights are then recomputed from *this* forward's router
logits over the replayed experts (softmax over all experts, gathered at the replayed ids, renormalised over the
top-k when the router has `norm_topk_prob`), so they stay differentiable in the router weights (R3, arXiv
2510.11370). Rows whose replayed ids are negative keep the router's own choice (the last token of a sequence,
which the engine never forwarded).

Routed experts travel in SGLang's layout (`return_routed_experts`): int32 `[seqlen - 1, num_layers, top_k]`
(one row per position 0..seqlen-2), base64 of the raw bytes in `meta_info["routed_experts"]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from miles.backends.fsdp_utils.context_parallel import (
    CPContext,
    all_gather_autograd,
    cp_gather_rows,
    cp_local_rows,
    cp_real_rows,
)
from miles.utils.routed_experts import (
    ROUTER_CLASS_NAMES,
    decode_routed_experts,
    encode_routed_experts,
    moe_routers,
)

__all__ = [
    "RoutingCapture",
    "decode_routed_experts",
    "encode_routed_experts",
    "moe_routers",
    "moe_routing",
    "pack_replay",
    "router_losses",
]


@dataclass
class RoutingCapture:
    """What one forward's routers did, per MoE layer (index into `moe_routers`)."""

    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, E] router logits (autograd)
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, K] expert ids used
    # context parallelism: the forward ran on this rank's chunk of the pack, whose first `real_rows` rows are pack
    # tokens (the rest CP padding); the router losses then reduce their statistics over `cp`
    cp: CPContext | None = None
    real_rows: int | None = None

    def stacked_experts(self) -> torch.Tensor:
        """[N, L, K] long: the experts every token was routed to, layer by layer."""
        return torch.stack([self.experts[i] for i in sorted(self.experts)], dim=1)


def replayed_gate(
    logits: torch.Tensor, own_ids: torch.Tensor, replay: torch.Tensor, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate weights and expert ids when `replay` [N, K] (negative rows: keep `own_ids`) replaces the top-k:
    softmax(logits) in fp32 gathered at the replayed ids, renormalised over them with `norm_topk_prob`."""
    keep_own = (replay < 0).any(dim=-1, keepdim=True)
    ids = torch.where(keep_own, own_ids, replay.to(own_ids.device, own_ids.dtype))
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


@contextlib.contextmanager
def moe_routing(model: nn.Module, replay: torch.Tensor | None = None) -> Iterator[RoutingCapture]:
    """Within the block, every router of `model` records into the yielded `RoutingCapture`; with `replay`
    ([N, L, K] ids of the N tokens of the forward, L = number of MoE layers) each layer routes token n to
    `replay[n, layer]` instead of its own top-k (see the module docstring)."""
    routers = moe_routers(model)
    if replay is not None and replay.shape[1] != len(routers):
        raise ValueError(
            f"routing replay has {replay.shape[1]} layers; the model has {len(routers)} MoE layers"
        )
    capture = RoutingCapture()
    handles = []
    for layer, router in enumerate(routers):

        def hook(module: nn.Module, args: object, output: tuple, layer: int = layer) -> tuple:
            logits, weights, ids = output
            if replay is not None:
                if replay.shape[0] != logits.shape[0]:
                    raise ValueError(
                        f"routing replay has {replay.shape[0]} tokens; the forward has {logits.shape[0]}"
                    )
                weights, ids = replayed_gate(logits, ids, replay[:, layer], module.norm_topk_prob)
            capture.logits[layer] = logits
            capture.experts[layer] = ids.detach()
            return logits, weights, ids

        handles.append(router.register_forward_hook(hook))
    try:
        yield capture
    finally:
        for h in handles:
            h.remove()


def router_losses(
    capture: RoutingCapture, num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(load-balancing loss, z-loss, metrics) of one forward, each loss summed over the MoE layers.

    Load balancing (Switch Transformer, Megatron's normalisation): per layer
    E / (K * T^2) * sum_e count_e * P_e, with count_e the tokens routed to expert e (the experts actually used,
    replayed or not) and P_e the summed router probability of e over the T tokens; 1 when perfectly balanced.
    z-loss: per layer the mean over tokens of logsumexp(logits)^2. Every token of the forward counts: a pack
    without context parallelism holds real tokens only. Metrics: `moe/load_max_over_mean` (largest expert load
    over the mean load, averaged over layers; 1 = balanced) and the two losses.

    Under context parallelism (`capture.cp`) the CP padding rows are left out and the counts, probability sums,
    z sums and token counts are summed over the CP group (differentiably: each rank's gradient is cp_size times
    its share, as for the CP log-probs), so every CP rank gets the unsplit pack's losses."""
    aux, z, imbalance = [], [], []
    for layer in sorted(capture.logits):
        logits = capture.logits[layer][: capture.real_rows].float()
        experts = capture.experts[layer][: capture.real_rows]
        n = logits.shape[0]
        counts = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
        probs_sum = F.softmax(logits, dim=-1).sum(dim=0)
        z_sq = torch.logsumexp(logits, dim=-1).square()
        if capture.cp is None:
            z.append(z_sq.mean())
        else:
            stats = torch.cat([counts, probs_sum, z_sq.sum()[None], z_sq.new_tensor([n])])[None]
            stats = all_gather_autograd(stats, capture.cp).sum(dim=0)
            counts, probs_sum = stats[:num_experts].detach(), stats[num_experts : 2 * num_experts]
            n = int(stats[-1])  # token counts are exact in fp32
            z.append(stats[-2] / n)
        aux.append((counts * probs_sum).sum() * (num_experts / (top_k * n * n)))
        imbalance.append(float(counts.max() / counts.mean()))
    aux_t, z_t = torch.stack(aux).sum(), torch.stack(z).sum()
    metrics = {
        "moe/aux_loss": float(aux_t.detach()),
        "moe/z_loss": float(z_t.detach()),
        "moe/load_max_over_mean": sum(imbalance) / len(imbalance),
    }
    return aux_t, z_t, metrics


def pack_replay(
    per_sample: Sequence[np.ndarray | torch.Tensor | None],
    lengths: Sequence[int],
    num_layers: int,
    top_k: int,
) -> torch.Tensor:
    """[T, L, K] long replay ids of a pack: each sample's rows ([len_i - 1 or len_i, L*K or L, K]) in pack
    order, -1 (the router's own choice) for rows a sample lacks (its last token, tool tokens appended after the
    last generation) or for a sample without any."""
    rows = []
    for experts, n in zip(per_sample, lengths):
        out = torch.full((n, num_layers, top_k), -1, dtype=torch.long)
        if experts is not None:
            # a copy: the engine's rows may be a read-only buffer (torch warns on non-writable arrays)
            if isinstance(experts, torch.Tensor):
                t = experts.long()
            else:
                t = torch.from_numpy(np.array(experts, dtype=np.int64))
            t = t.reshape(t.shape[0], num_layers, top_k)
            if t.shape[0] > n:
                raise ValueError(f"routed experts have {t.shape[0]} rows for a sequence of {n} tokens")
            out[: t.shape[0]] = t
        rows.append(out)
    return torch.cat(rows)


class MoETraining:
    """The policy's MoE hooks over one rollout batch: which routing each forward replays, what it records, and
    the router losses and metrics of a training micro-batch. A dense model (no routers) makes every hook a no-op.

    Replay source, per pack: the engine's experts (`rollout_replay`, R3: every forward of the batch); else, with
    `routing_replay`, the experts the batch's first forward over that pack used (the old log-probs pass, or the
    first training micro-batch when that pass is skipped); else the router's own top-k."""

    def __init__(
        self,
        model: nn.Module,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        rollout_replay: bool = False,
        routing_replay: bool = False,
        cp: CPContext | None = None,
    ) -> None:
        self.model = model
        # context parallelism: each forward sees this rank's chunk of a pack
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.routers = moe_routers(model)
        asked = {
            "--moe-aux-loss-coeff": aux_loss_coeff > 0,
            "--moe-z-loss-coeff": z_loss_coeff > 0,
            "--use-rollout-routing-replay": rollout_replay,
            "--use-routing-replay": routing_replay,
        }
        if not self.routers and any(asked.values()):
            flags = ", ".join(f for f, on in asked.items() if on)
            raise ValueError(
                f"{flags}: the model has no MoE layers (supported routers: {ROUTER_CLASS_NAMES})"
            )
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.rollout_replay, self.routing_replay = rollout_replay, routing_replay
        self.num_experts = int(self.routers[0].num_experts) if self.routers else 0
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.rollout: list[object] | None = None
        self.recorded: dict[int, torch.Tensor] = {}

    def start_batch(self, routed: Sequence[object | None]) -> None:
        """A new rollout batch: `routed` is each sample's `rollout_routed_experts` (R3), in batch order."""
        self.recorded = {}
        self.rollout = None
        if self.routers and self.rollout_replay:
            missing = [i for i, r in enumerate(routed) if r is None]
            if missing:
                raise ValueError(
                    f"--use-rollout-routing-replay: the engine returned no routed experts for {len(missing)} "
                    "samples (does it serve return_routed_experts? SGLang needs --enable-return-routed-experts)"
                )
            self.rollout = list(routed)

    @contextlib.contextmanager
    def forward(
        self, tokens: Sequence[Sequence[int]], indices: Sequence[int]
    ) -> Iterator[RoutingCapture | None]:
        """Around one forward over the pack of batch samples `indices` (`tokens`: the batch's token ids)."""
        if not self.routers:
            yield None
            return
        lengths = [len(tokens[i]) for i in indices]
        per_sample = None
        if self.rollout is not None:
            per_sample = [self.rollout[i] for i in indices]
        elif self.routing_replay and all(i in self.recorded for i in indices):
            per_sample = [self.recorded[i] for i in indices]
        replay = None
        if per_sample is not None:
            replay = pack_replay(per_sample, lengths, len(self.routers), self.top_k)
            if self.cp is not None:  # the replayed experts are split exactly as the pack's tokens
                replay = cp_local_rows(replay, self.cp, fill=-1)
        with moe_routing(self.model, replay) as capture:
            if self.cp is not None:
                capture.cp, capture.real_rows = self.cp, cp_real_rows(sum(lengths), self.cp)[2]
            yield capture
        if self.routing_replay and self.rollout is None and per_sample is None:
            used = capture.stacked_experts()
            if self.cp is not None:
                used = cp_gather_rows(used, self.cp, sum(lengths))
            for i, experts in zip(indices, used.cpu().split(lengths)):
                self.recorded[i] = experts

    def loss(
        self, capture: RoutingCapture | None, num_micro_batches: int
    ) -> tuple[torch.Tensor | None, dict]:
        """(the router losses' share of one micro-batch's loss or None when both weights are 0, metrics).
        Each micro-batch's losses are token means over its pack, divided by the step's micro-batch count (a
        mean over the step's micro-batches; FSDP's gradient average makes it the mean over DP ranks)."""
        if capture is None or not capture.logits:
            return None, {}
        aux, z, metrics = router_losses(capture, self.num_experts, self.top_k)
        if not (self.aux_loss_coeff or self.z_loss_coeff):
            return None, metrics
        return (self.aux_loss_coeff * aux + self.z_loss_coeff * z) / num_micro_batches, metrics
