"""Tensor parallelism of HF decoders (`--tensor-model-parallel-size`, issue 28) with torch's DTensor plans: dense
decoders and Qwen3-MoE.

The plan is the model's own: transformers declares for each decoder class which projections split by columns and
which by rows (``config.base_model_tp_plan``, e.g. Qwen3's ``layers.*.self_attn.q_proj: colwise``). Each decoder
layer is parallelised with torch.distributed.tensor.parallel over the 1-D ``tp`` mesh:

- ``colwise`` (q/k/v, gate/up): `ColwiseParallel`; the replicated input's gradient is summed over the TP ranks;
  the output is this rank's slice of the heads / of the intermediate features (a plain tensor: the HF attention
  reshapes with ``-1`` heads, so it runs on the local heads, packed varlen attention included);
- ``rowwise`` (o, down): `RowwiseParallel`, its partial sums all-reduced into the replicated hidden state;
- ``replicated_with_grad_allreduce`` (Qwen3's per-head q/k norms): the weight is replicated and the input is seen
  as sharded on its heads dimension (`SequenceParallel` over dim 2 of ``[batch, tokens, heads, head_dim]``), so
  the weight's gradient is summed over the TP ranks.

Everything else (embeddings, the layer norms, the LM head) stays replicated: every TP rank computes it on the same
tokens, so its gradient is the same on every TP rank. FSDP2 then shards over the data-parallel mesh only.

MoE (Qwen3-MoE): attention is split as above; each sparse layer's MoE block (router and experts) is kept whole on
every TP rank (the plan's ``mlp.experts*`` entries, `KEPT_WHOLE`, are not applied). The block's input is the
replicated hidden state after the row-parallel ``o_proj``'s all-reduce, so every TP rank routes the same tokens to
the same experts with the same gate weights: routing replay (R3) and the router losses give the numbers of one
unsplit model, and the experts' and router's gradients, summed back through the column-parallel q/k/v (whose input
gradient is all-reduced over TP), are the same on every TP rank; FSDP2 shards the experts over the DP ranks like
the layer norms. Why not split each expert (gate/up by columns, down by rows, one all-reduce after the weighted
sum): transformers stores a layer's gate and up projections fused as ``gate_up_proj [E, 2I, H]``, whose column
split (``packed_colwise``) is not a DTensor placement, so its DTensor would hold the rows in another order than the
HF checkpoint: DCP checkpoints would not resume across a changed TP size and the refit would need a reorder. The
experts' memory is split by expert parallelism instead (`expert_parallel.py`). A dense MLP layer of a MoE model
(``mlp_only_layers``) is split by the plan's ``mlp.gate_proj`` / ``up_proj`` / ``down_proj`` entries, which
resolve only in those layers.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from miles.config.tp_rules import tp_problems

_FLAG = "--tensor-model-parallel-size"
_LAYER_PREFIX = "layers.*."
HEADS_DIM = 2  # of the [batch, tokens, heads, head_dim] input of a per-head norm
SUPPORTED_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
KEPT_WHOLE = "mlp.experts"  # MoE experts: replicated over TP (module docstring), their plan entries skipped


def _style(name: str, style: str) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "replicated_with_grad_allreduce":
        return SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)
    raise ValueError(
        f"{_FLAG}: the model's tensor-parallel plan gives {name!r} the style {style!r}; supported: "
        f"{SUPPORTED_STYLES} (issue 28)"
    )


def layer_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The per-decoder-layer plan (module name inside a layer -> torch parallel style) from the model's
    ``config.base_model_tp_plan``."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    out = {}
    for name, style in plan.items():
        if not name.startswith(_LAYER_PREFIX):
            raise ValueError(
                f"{_FLAG}: the model's tensor-parallel plan names {name!r} outside the decoder layers"
            )
        local = name.removeprefix(_LAYER_PREFIX)
        if local == KEPT_WHOLE or local.startswith(KEPT_WHOLE + "."):
            continue
        out[local] = _style(name, style)
    if not out:
        raise ValueError(
            f"{_FLAG}: {type(model).__name__} declares no tensor-parallel plan (base_model_tp_plan)"
        )
    return out


def _resolves(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parallelise every decoder layer of the (meta or materialised) HF decoder ``model`` over ``tp_mesh``, in
    place, with the entries of `layer_plan` that name a module of that layer (a MoE model's dense-MLP entries
    resolve only in its dense layers). ValueError naming the flag when the model cannot be split that way."""
    from miles.backends.fsdp_utils.model import decoder_layers

    problems = tp_problems(model.config.to_dict(), tp_mesh.size())
    if problems:
        raise ValueError(f"{_FLAG}={tp_mesh.size()}: " + "; ".join(problems))
    plan = layer_plan(model)
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, {k: v for k, v in plan.items() if _resolves(layer, k)})
