"""CUDA-IPC tensor handles name their device by UUID, as SGLang's `monkey_patch_torch_reductions` expects: a
local device index names another GPU in an engine that sees the devices in another order (issue 7). The
cross-process round trip is checked by `bash scripts/gpu-check.sh` (refit into the embedded engine)."""

from __future__ import annotations

import base64

import torch

from miles.utils.serialization import serialize, share_named_tensors


def test_handles_carry_the_device_uuid():
    t = torch.arange(8.0, device="cuda")
    payload = base64.b64decode(serialize(share_named_tensors([("w", t)])))
    assert str(torch.cuda.get_device_properties(t.device).uuid).encode() in payload
