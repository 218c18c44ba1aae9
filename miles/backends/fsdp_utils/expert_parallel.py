"""Expert parallelism of Qwen3-MoE decoders (`--expert-model-parallel-size E`, issue 28).

Layout: the training ranks are split into groups of E consecutive ranks (the ``ep`` dimension of a row-major
``(edp, ep)`` mesh over all ranks, ``edp = world / E``). The E ranks of a group hold disjoint slices of every MoE
layer's experts: rank ``ep_rank`` holds experts ``[ep_rank * n, (ep_rank + 1) * n)``, ``n = num_experts / E``.
Everything else (attention, norms, embeddings, the router) is replicated over ``ep``.

Composition with FSDP2 (the scheme, and why it is exact):

- the stacked expert weights (transformers' ``mlp.experts.gate_up_proj [E_all, 2I, H]`` and ``down_proj
  [E_all, H, I]``) become DTensors sharded on their expert dim over the ``ep`` mesh, and the experts module is its
  own FSDP2 unit over the ``edp`` mesh (the ranks that hold the same experts); every other parameter is sharded by
  FSDP2 over all data-parallel ranks as without EP. Both meshes come from the same root, so FSDP2 composes them as
  it does tensor parallelism (the loader, the refit's ``full_tensor``, DCP and the gradient clip see ordinary
  DTensors with the full HF shape and names);
- every rank still trains on its own data-parallel samples. In a MoE block each rank sends every (token, k) pair
  to the rank holding expert k's weights (`all_to_all_single`, autograd-aware: its backward is the reverse
  all-to-all), the owner computes the expert MLP on the rows it received, the outputs go back the same way and
  the sender weights them with its gate weights and sums them per token. So a rank's forward is the EP1 forward;
- gradients: the expert weights of a rank receive the gradient of the losses of all E ranks of its group (the
  all-to-all's backward brings it back), and FSDP2 averages over the ``edp`` ranks (world / E of them); the
  non-expert weights get the average over all world ranks. Scaling the expert weights' gradient by 1/E (exact in
  binary for E a power of two, `_ScaleGrad`) makes both the average over all ranks, as with EP1.

The router is untouched: routing replay (R3) and the router losses hook it (`moe.moe_routing`) before dispatch.

With context parallelism (``cp_size`` C) the ranks are numbered row-major over ``(dp, cp)`` (rank = dp_rank * C +
cp_rank) and the EP groups are still E consecutive ranks: one CP group when E = C, part of one when E < C, E / C
whole replicas when E > C. Nothing above depends on which samples or which chunk a rank holds: each rank dispatches
its own chunk's tokens (CP padding included; its outputs are never read), and the gradient argument holds with the
CP ranks' gradients (each cp_size times its share, see `context_parallel.py`) in place of the data-parallel ones.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

_FLAG = "--expert-model-parallel-size"
EXPERT_CLASS_NAMES = ("Qwen3MoeExperts",)


@functools.cache
def expert_meshes(device_type: str, ep_size: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, edp mesh) of this rank: the row-major ``(edp, ep)`` mesh over all ranks, built once per process."""
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"{_FLAG}={ep_size}: must be >= 1 and divide the number of training ranks ({world})")
    mesh = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    return mesh["ep"], mesh["edp"]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ExpertParallelExperts(nn.Module):
    """A MoE layer's experts, ``num_experts / E`` of them on this rank, with all-to-all dispatch and combine.
    Same parameter names and global shapes as transformers' ``Qwen3MoeExperts`` (``gate_up_proj``,
    ``down_proj``), held as DTensors sharded on the expert dim over ``ep_mesh``."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts = int(experts.num_experts)
        self.ep_size = ep_mesh.size()
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"{_FLAG}={self.ep_size} must divide the model's num_experts={self.num_experts} (issue 28)"
            )
        self.local_experts = self.num_experts // self.ep_size
        self.ep_rank = ep_mesh.get_local_rank()
        self.group = ep_mesh.get_group()
        self.act_fn = experts.act_fn
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            self.register_parameter(name, nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)])))

    def _local(self, name: str) -> torch.Tensor:
        w = getattr(self, name)
        w = w.to_local() if isinstance(w, DTensor) else w
        return _ScaleGrad.apply(w, 1.0 / self.ep_size)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """[N, H] hidden states, [N, K] expert ids and gate weights -> [N, H] the weighted sum of the experts."""
        k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)  # (token, k) pairs by expert, so by destination rank
        token = order // k
        sorted_ids = ids[order]
        send = torch.bincount(sorted_ids // self.local_experts, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        rows = hidden_states.new_empty((sum(recv_splits), hidden_states.shape[-1]))
        rows = all_to_all_single(rows, hidden_states[token], recv_splits, send_splits, group=self.group)
        recv_ids = sorted_ids.new_empty((sum(recv_splits),))
        dist.all_to_all_single(recv_ids, sorted_ids.contiguous(), recv_splits, send_splits, group=self.group)
        out = self._experts(rows, recv_ids - self.ep_rank * self.local_experts)
        back = out.new_empty((ids.shape[0], out.shape[-1]))
        back = all_to_all_single(back, out, send_splits, recv_splits, group=self.group)
        weighted = back * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))

    def _experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The local experts' MLP on the received ``rows`` (``local_ids``: each row's local expert)."""
        gate_up, down = self._local("gate_up_proj"), self._local("down_proj")
        out = rows.new_zeros((rows.shape[0], down.shape[1]))
        for e in range(self.local_experts):
            idx = (local_ids == e).nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            gate, up = F.linear(rows[idx], gate_up[e]).chunk(2, dim=-1)
            out = out.index_copy(0, idx, F.linear(self.act_fn(gate) * up, down[e]))
        if rows.shape[0] == 0:
            # no token for this rank's experts: the output must still depend on the rows and weights, or autograd
            # skips this rank's side of the all-to-alls' backward (and the weights' gradient) that its peers run
            out = out + 0.0 * (rows.sum() + gate_up.sum() + down.sum())
        return out


def expert_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts module) of every MoE layer's experts."""
    found = []
    for parent in model.modules():
        child = getattr(parent, "experts", None)
        if isinstance(child, nn.Module) and type(child).__name__ in EXPERT_CLASS_NAMES:
            found.append((parent, "experts", child))
    return found


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Replace every MoE layer's experts of the (meta) HF model by `ExpertParallelExperts` over ``ep_mesh``, in
    place; returns the new modules (each its own FSDP2 unit over the edp mesh). ValueError naming the flag for a
    model without supported experts."""
    found = expert_modules(model)
    if not found:
        raise ValueError(
            f"{_FLAG}={ep_mesh.size()}: {type(model).__name__} has no MoE experts this backend can split "
            f"(supported: {EXPERT_CLASS_NAMES}; dense models train with {_FLAG} 1) (issue 28)"
        )
    units = []
    for parent, attr, experts in found:
        unit = ExpertParallelExperts(experts, ep_mesh)
        setattr(parent, attr, unit)
        units.append(unit)
    return units
