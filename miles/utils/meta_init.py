"""Building a model without reading or initialising its weights: parameters registered on the meta device
(`parameters_on_meta`), then given uninitialised storage (`materialize_parameters`). The training ranks build
their FSDP2 models so (`miles.backends.fsdp_utils.hf_load`); an embedded engine whose first refit brings its
weights starts so (`miles.engines.local.vl_runner.load_model` with ``weights=False``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, every parameter a module registers goes to the meta device as it is registered (its
    initialisation then runs on meta: no memory, no time), while buffers stay real: a model built here has
    the non-persistent buffers it computes in its constructor (rotary ``inv_freq``) and no weights. Each
    parameter is allocated (uninitialised) for the instant of its registration only."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def materialize_parameters(model: nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter of ``model`` uninitialised storage on ``device`` (nothing is written: the pages
    stay untouched until used); buffers are left as they are (``Module.to_empty`` would empty them too), and a
    parameter shared by several modules (tied embeddings) stays one parameter."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in new:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                new[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            module._parameters[name] = new[id(param)]


def has_persistent_buffers(model: nn.Module) -> bool:
    """Whether ``model`` has buffers saved in its state dict (a checkpoint then holds their values)."""
    return any(
        name not in module._non_persistent_buffers_set
        for module in model.modules()
        for name, _ in module.named_buffers(recurse=False)
    )
