"""The embedded engine's --device: refused when it is not a usable torch device; weights stay on their device."""

from __future__ import annotations

import pytest
import torch

from miles.engines.local.engine import _device
from miles.engines.local.weights import WeightStore


def test_device_flag_is_checked():
    assert _device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device 'gpu0' is not a torch device"):
        _device("gpu0")
    with pytest.raises(ValueError, match="--device 'meta': allowed cpu, cuda, cuda:N"):
        _device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda:0: no such CUDA device"):
            _device("cuda:0")


def test_release_and_resume_keep_the_device():
    model = torch.nn.Linear(4, 3).to("meta")  # any non-CPU device shows where storage is re-allocated
    store = WeightStore(model)
    store.release()
    assert model.weight.device.type == "meta" and model.weight.numel() == 0
    store.resume()
    assert model.weight.device.type == "meta" and tuple(model.weight.shape) == (3, 4)
    assert store.pending == {"weight", "bias"}
