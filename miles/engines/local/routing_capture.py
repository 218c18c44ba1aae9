"""Routed experts of the embedded engine: SGLang 0.5.23's `return_routed_experts`, for rollout routing replay (R3).

SGLang records, at every forward, the top-k experts each fed token was routed to in every layer, when the server
runs with `--enable-return-routed-experts`; a request with `return_routed_experts: true` then gets
`meta_info["routed_experts"]`: base64 of an int32 array [seqlen - 1, num_layers, top_k] (positions
0..seqlen-2 of prompt + output: the last sampled token is never fed; `miles.utils.routed_experts`). Without the
server flag SGLang accepts the request field and returns no `routed_experts` (its capturer does not exist).

Here the same: with `--enable-return-routed-experts`, hooks on every MoE router of the model
(`miles.utils.routed_experts.moe_routers`) record, for every request that asked, the experts of each position:
- the KV-cache runner (`PoolRunner`, which serves Qwen3-MoE; `PoolRouting`) feeds every position of a request
  once, packed with the other rows' tokens: each row takes its span of the packed tokens (a prompt fed as a copy
  of an identical row's takes that row's span: same tokens, same positions, same experts);
- the full-forward runner (`NoCacheRunner`, which serves Qwen3-Next; `RecordingRunner`) recomputes earlier
  positions at every step: each position is kept from the forward that first computed it.
Either way a retracted request's positions are recorded again, as SGLang's are.

Test aid (miles-only, `--test-off-top-k-every N`): on positions 0, N, 2N, ... of each sequence every MoE layer
routes to its 2nd..(k+1)-th best experts instead of its top k, the gate weights recomputed over them from the
router's softmax (renormalised with `norm_topk_prob`, as Qwen3-MoE does): an engine whose expert choice differs
from the trainer's own top-k while the weights are equal, which R3 must absorb.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from miles.engines.local.full_forward import NoCacheRunner
from miles.engines.local.model_runner import PoolRunner
from miles.engines.local.scheduler import Batch
from miles.utils.routed_experts import ROUTER_CLASS_NAMES, moe_routers

if TYPE_CHECKING:
    from miles.engines.local.model_runner import _Packed


def off_top_k(
    logits: torch.Tensor,
    ids: torch.Tensor,
    every: int,
    norm_topk_prob: bool,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights, expert ids) [N, K] when the rows at positions 0, every, 2*every, ... of the router's top-k
    `ids` become its 2nd..(K+1)-th best experts; weights: softmax(logits) in fp32 at the ids, renormalised with
    `norm_topk_prob`. `positions` [N]: each row's position (packed tokens); None: row i is position i."""
    k = ids.shape[-1]
    ranked = logits.float().argsort(dim=-1, descending=True)
    rows = slice(None, None, every) if positions is None else positions % every == 0
    ids = ids.clone()
    ids[rows] = ranked[rows, 1 : k + 1].to(ids.dtype)
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
        self.positions: torch.Tensor | None = None  # [N] of the packed tokens routed now; None: 0..N-1
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._hook, layer))

    def _hook(self, layer: int, module: nn.Module, args: object, output: tuple) -> tuple:
        logits, weights, ids = output
        if self.off_top_k_every:
            norm = bool(module.norm_topk_prob)
            weights, ids = off_top_k(logits, ids, self.off_top_k_every, norm, self.positions)
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


class PoolRouting:
    """The routing of `PoolRunner`'s forwards (`PoolRunner.routing`): the off-top-k test aid by the packed tokens'
    positions, and with `record` each row's experts into `Request.routed_experts` (int32 [positions, L, K])."""

    def __init__(self, hooks: RoutingHooks, record: bool):
        self.hooks = hooks
        self.record = record

    @contextmanager
    def capture(self, batch: Batch, packed: _Packed) -> Iterator[None]:
        """Around the decoder layers of one forward of `batch`, packed as `packed`."""
        hooks = self.hooks
        record = self.record and any(r.req.return_routed_experts for r in batch.rows)
        hooks.positions, hooks.forwards = packed.positions, [] if record else None
        try:
            yield
            forwards = hooks.forwards
        finally:
            hooks.positions = hooks.forwards = None
        if not forwards:
            return
        (layers,) = forwards  # the decoder layers ran once, over every packed token
        packed_experts = torch.stack(layers, dim=1).to("cpu", torch.int32)  # [packed tokens, L, K]
        for row in batch.rows:
            req = row.req
            if not req.return_routed_experts:
                continue
            end = packed.last[id(row)] + 1
            fed = packed_experts[end - len(row.token_ids) : end]  # positions row.start.. of this request
            prev = req.routed_experts
            if prev is None or row.start == 0:
                req.routed_experts = fed
            else:  # the KV cache holds positions < row.start, each computed (and recorded) once
                req.routed_experts = torch.cat([prev[: row.start], fed])


def routing_hooks(runner: object) -> RoutingHooks | None:
    """The routing hooks a runner from `routing_runner` has; None for other runners."""
    if isinstance(runner, RecordingRunner):
        return runner.hooks
    routing = getattr(runner, "routing", None)
    return None if routing is None else routing.hooks


def routing_runner(
    runner: NoCacheRunner | PoolRunner, model: nn.Module, record: bool, off_top_k_every: int
) -> NoCacheRunner | PoolRunner | None:
    """The runner serving with routed experts recorded or perturbed (the KV-cache runner itself, given its
    `routing`; a `RecordingRunner` in place of the full-forward runner); None when neither is asked.
    ValueError when the model has no MoE routers."""
    if not record and not off_top_k_every:
        return None
    if isinstance(runner, PoolRunner):
        runner.routing = PoolRouting(RoutingHooks(model, off_top_k_every), record)
        return runner
    if not isinstance(runner, NoCacheRunner):
        raise ValueError(
            "--enable-return-routed-experts / --test-off-top-k-every: the model has no MoE routers "
            f"(supported: {', '.join(ROUTER_CLASS_NAMES)})"
        )
    return RecordingRunner(model, record, off_top_k_every)
