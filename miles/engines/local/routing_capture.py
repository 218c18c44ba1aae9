"""Routed experts of the embedded engine: SGLang 0.5.23's `return_routed_experts`, for rollout routing replay (R3).

SGLang records, at every forward, the top-k experts each fed token was routed to in every layer, when the server
runs with `--enable-return-routed-experts`; a request with `return_routed_experts: true` then gets
`meta_info["routed_experts"]`: base64 of an int32 array [seqlen - 1, num_layers, top_k] (positions
0..seqlen-2 of prompt + output: the last sampled token is never fed; `miles.utils.routed_experts`). Without the
server flag SGLang accepts the request field and returns no `routed_experts` (its capturer does not exist).

Here the same: with `--enable-return-routed-experts`, `RecordingRunner` (the full-forward runner that serves MoE
models, `NoCacheRunner`) hooks every MoE router of the model (`miles.utils.routed_experts.moe_routers`) and, for
every request that asked, keeps the experts of each position from the forward that first computed it (a full
forward recomputes earlier positions; a retracted request's positions are recorded again, as SGLang's are).

Test aid (miles-only, `--test-off-top-k-every N`): on positions 0, N, 2N, ... of each sequence every MoE layer
routes to its 2nd..(k+1)-th best experts instead of its top k, the gate weights recomputed over them from the
router's softmax (renormalised with `norm_topk_prob`, as Qwen3-MoE does): an engine whose expert choice differs
from the trainer's own top-k while the weights are equal, which R3 must absorb.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from miles.engines.local.full_forward import NoCacheRunner
from miles.engines.local.scheduler import Batch
from miles.utils.routed_experts import ROUTER_CLASS_NAMES, moe_routers


def off_top_k(
    logits: torch.Tensor, ids: torch.Tensor, every: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights, expert ids) [N, K] when rows 0, every, 2*every, ... of the router's top-k `ids` become its
    2nd..(K+1)-th best experts; weights: softmax(logits) in fp32 at the ids, renormalised with `norm_topk_prob`."""
    k = ids.shape[-1]
    ranked = logits.float().argsort(dim=-1, descending=True)
    ids = ids.clone()
    ids[::every] = ranked[::every, 1 : k + 1].to(ids.dtype)
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class RoutingHooks:
    """Forward hooks on every MoE router of `model`: record the experts used per forward (`recording`), and
    with `off_top_k_every` > 0 route some positions off the top-k (the test aid of the module docstring)."""

    def __init__(self, model: nn.Module, off_top_k_every: int = 0):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                "--enable-return-routed-experts / --test-off-top-k-every: the model has no MoE routers "
                f"(supported: {', '.join(ROUTER_CLASS_NAMES)})"
            )
        if off_top_k_every < 0 or (off_top_k_every and self.routers[0].top_k >= self.routers[0].num_experts):
            raise ValueError(
                f"--test-off-top-k-every {off_top_k_every} must be >= 0, and > 0 needs more experts than top_k"
            )
        self.off_top_k_every = off_top_k_every
        self.forwards: list[list[torch.Tensor]] | None = None  # per model forward: each layer's [N, K] ids
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._hook, layer))

    def _hook(self, layer: int, module: nn.Module, args: object, output: tuple) -> tuple:
        logits, weights, ids = output
        if self.off_top_k_every:
            weights, ids = off_top_k(logits, ids, self.off_top_k_every, bool(module.norm_topk_prob))
        if self.forwards is not None:
            if layer == 0:
                self.forwards.append([])
            self.forwards[-1].append(ids.detach())
        return logits, weights, ids


class RecordingRunner(NoCacheRunner):
    """The full-forward runner, recording the routed experts of the requests that ask for them
    (`Request.return_routed_experts`) into `Request.routed_experts` (int32 [positions, layers, top_k])."""

    def __init__(self, model: nn.Module, record: bool, off_top_k_every: int = 0):
        super().__init__(model)
        self.record = record
        self.hooks = RoutingHooks(model, off_top_k_every)

    def forward(self, batch: Batch) -> torch.Tensor:
        """`NoCacheRunner.forward` (one full forward per sampling row, in row order), then each row's routing."""
        if not self.record:
            return super().forward(batch)
        self.hooks.forwards = []
        try:
            logits = super().forward(batch)
            forwards = self.hooks.forwards
        finally:
            self.hooks.forwards = None
        for row, layers in zip([r for r in batch.rows if r.sample], forwards):
            req = row.req
            if not req.return_routed_experts:
                continue
            seq = torch.stack(layers, dim=1).to("cpu", torch.int32)  # [positions fed, L, K], from position 0
            prev = req.routed_experts
            keep = 0 if prev is None else min(len(prev), row.start)  # positions an earlier forward computed
            req.routed_experts = seq if prev is None or not keep else torch.cat([prev[:keep], seq[keep:]])
        return logits


def routing_runner(
    runner: NoCacheRunner | object, model: nn.Module, record: bool, off_top_k_every: int
) -> RecordingRunner | None:
    """The runner replacing `runner` when routed experts are recorded or perturbed; None when neither is asked.
    ValueError when `runner` is not the full-forward runner (MoE models are served by it)."""
    if not record and not off_top_k_every:
        return None
    if not isinstance(runner, NoCacheRunner):
        raise ValueError(
            "--enable-return-routed-experts / --test-off-top-k-every: the model has no MoE routers "
            f"(supported: {', '.join(ROUTER_CLASS_NAMES)})"
        )
    return RecordingRunner(model, record, off_top_k_every)
