"""Linear-attention (hybrid) models in a packed row: each sequence's recurrent state starts from zero.

A linear-attention layer (Qwen3-Next's gated delta net) carries a recurrent state and a causal-conv window along
its input; over a packed row of several sequences both would flow from one sequence into the next. transformers
forwards the packed boundaries (`cu_seq_lens_q`) to the layer, but its torch fallback (the CPU path) ignores them,
and the GPU kernels' varlen support covers the delta rule only, not the conv window. So `segment_linear_attention`
makes every linear-attention layer of a model run once per sequence of the row (a slice of the row's hidden states
each, outputs concatenated back): each sequence computes what its unpacked forward computes, whichever kernel
runs. Full-attention layers keep the varlen attention of packed_attention.py and MoE blocks are per token, so a
packed forward of a hybrid model equals the per-sample forwards (tests/unit/test_hybrid_next.py).

Context parallelism would cut a sequence's recurrence across ranks, and TP/EP plans do not know these layers:
`config/hybrid_rules.py` refuses them for linear-attention models at validation (issue 28).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "LINEAR_ATTENTION_CLASS_NAMES",
    "KERNELS_EXTRA",
    "has_linear_attention",
    "linear_attention_kernels",
    "linear_attention_layers",
    "segment_linear_attention",
]

# transformers' linear-attention modules whose forward is (hidden_states [B, T, H], cache, attention_mask, **kwargs)
LINEAR_ATTENTION_CLASS_NAMES = ("Qwen3NextGatedDeltaNet",)
# the optional GPU kernels transformers uses for them when installed: pip distribution -> import name
KERNELS_EXTRA = "hybrid"
_KERNELS = {"flash-linear-attention": "fla", "causal-conv1d": "causal_conv1d"}
# the packed-row kwargs a single sequence's forward must not see
_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "miles_layout")
_SEGMENTED = "_miles_segmented"
# on the model: how many layers `segment_linear_attention` covered
_COVERED = "_miles_linear_attention_layers"


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    """Every linear-attention module of `model` (a torch module, plain or FSDP2-wrapped), in layer order."""
    return [m for m in model.modules() if type(m).__name__ in LINEAR_ATTENTION_CLASS_NAMES]


def has_linear_attention(model_or_config: Any) -> bool:
    """Whether a model (module) or an HF config (its `layer_types`) has linear-attention layers."""
    if isinstance(model_or_config, nn.Module):
        return bool(linear_attention_layers(model_or_config))
    return "linear_attention" in (getattr(model_or_config, "layer_types", None) or ())


def linear_attention_kernels(required: bool = False) -> list[str]:
    """The optional kernel packages (pip names) that are missing; with `required` an ImportError naming the
    extra when any is. Only looked up, never imported here: transformers imports them itself when present."""
    missing = [pip for pip, mod in _KERNELS.items() if importlib.util.find_spec(mod) is None]
    if missing and required:
        raise ImportError(
            f"linear attention kernels {missing} are not installed: pip install 'miles[{KERNELS_EXTRA}]' "
            "(GPU only; without them transformers runs its torch fallback, correct but slow)"
        )
    return missing


def _segmented(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`original` (a bound linear-attention forward) run once per sequence of a packed [1, T, H] row."""

    @functools.wraps(original)
    def forward(
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or cache is not None or hidden_states.shape[0] != 1:
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in _ROW_KWARGS}
        bounds = [
            int(b) for b in cu.tolist()
        ]  # one host sync per layer; the per-sequence loop needs them anyway
        if bounds[0] != 0 or bounds[-1] != hidden_states.shape[1]:
            raise ValueError(
                f"cu_seq_lens_q {bounds[0]}..{bounds[-1]} does not span the {hidden_states.shape[1]}-token row"
            )
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                mask = None if attention_mask is None else attention_mask[:, start:end]
                outs.append(original(hidden_states[:, start:end], cache=None, attention_mask=mask, **rest))
        return torch.cat(outs, dim=1)

    return forward


def segment_linear_attention(model: nn.Module) -> int:
    """Make every linear-attention layer of `model` reset its state at the packed row's sequence boundaries (see
    the module docstring). Idempotent; returns how many layers it covers (0 for a model without any). The count
    is kept on the model: later calls (every packed forward's) return it without walking the modules again."""
    covered = model.__dict__.get(_COVERED)
    if covered is not None:
        return int(covered)
    layers = linear_attention_layers(model)
    for layer in layers:
        if not getattr(layer, _SEGMENTED, False):
            layer.forward = _segmented(layer.forward)
            setattr(layer, _SEGMENTED, True)
    if layers and not getattr(model, _SEGMENTED, False):
        setattr(model, _SEGMENTED, True)
        device = next(model.parameters()).device
        missing = linear_attention_kernels()
        if device.type == "cuda" and missing:
            logger.warning(
                "linear attention runs transformers' torch fallback: %s not installed (pip install 'miles[%s]')",
                ", ".join(missing),
                KERNELS_EXTRA,
            )
    model.__dict__[_COVERED] = len(layers)
    return len(layers)
