"""Pure pieces of the SGLang contract: key levels, device-UUID handles, the restricted unpickler, checksums."""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from miles.engines.local.server import auth_allowed
from miles.utils import serialization
from miles.utils.weight_checksum import overall_checksum, tensor_checksum


@pytest.mark.parametrize(
    ("path", "header", "api_key", "admin_key", "allowed"),
    [
        ("/generate", None, None, "adm", True),  # admin key only: generation stays open
        ("/flush_cache", None, None, "adm", False),
        ("/flush_cache", "Bearer adm", None, "adm", True),
        ("/flush_cache", "Bearer api", "api", "adm", False),  # with both, the API key does not open admin
        ("/generate", None, "api", "adm", False),  # --api-key guards everything
        ("/generate", "bearer api", "api", None, True),  # scheme is case-insensitive
        ("/health_generate", None, "api", "adm", True),
        ("/update_weights_from_tensor", "Bearer api", "api", None, True),  # no admin key: the API key
        ("/begin_weight_update", None, None, None, True),
    ],
)
def test_auth_levels_follow_sglang(path, header, api_key, admin_key, allowed):
    assert auth_allowed(path, header, api_key, admin_key) is allowed


def test_device_travels_as_uuid(monkeypatch):
    props = {0: SimpleNamespace(uuid="GPU-aaa"), 1: SimpleNamespace(uuid="GPU-bbb")}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[d])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = tuple(range(6)) + (1, "x")
    sent = serialization.with_device_uuid(args)
    assert sent[6] == "GPU-bbb" and sent[:6] == args[:6] and sent[7:] == args[7:]
    # a receiver that sees the GPUs in another order maps the UUID back to its own index
    props[0], props[1] = props[1], props[0]
    assert serialization.with_device_index(sent)[6] == 0
    assert serialization.with_device_index(args)[6] == 1  # an index from an unpatched sender is kept
    with pytest.raises(serialization.PayloadError, match="GPU-zzz"):
        serialization.device_from_uuid("GPU-zzz")


def test_rebuild_function_keeps_torch_name():
    serialization.patch_torch_reductions()
    from torch.multiprocessing import reductions

    fn = reductions.rebuild_cuda_tensor
    assert (fn.__module__, fn.__qualname__) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
    assert pickle.loads(pickle.dumps(fn)) is fn  # what SGLang's allow-list names


def test_restricted_unpickler():
    named = [("w", torch.arange(4.0))]
    got = serialization.deserialize(serialization.serialize(serialization.share_named_tensors(named)))
    assert got[0][0] == "w" and torch.equal(got[0][1], named[0][1])
    with pytest.raises(serialization.PayloadError, match="posix.system"):
        serialization.deserialize(base64.b64encode(pickle.dumps(os.system)).decode())
    with pytest.raises(serialization.PayloadError, match="not base64"):
        serialization.deserialize("%%%")
    with pytest.raises(serialization.PayloadError, match="not a tensor pickle"):
        serialization.deserialize(base64.b64encode(b"\x80\x04garbage").decode())


def test_checksums_are_sglangs():
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    raw = t.view(torch.uint8).numpy().tobytes()
    assert tensor_checksum(t) == hashlib.sha256(raw).digest()[:8].hex()
    assert tensor_checksum(t) != tensor_checksum(t.float())  # raw bytes: the dtype matters
    h = hashlib.sha256()
    for name, c in sorted({"b": "2", "a": "1"}.items()):
        h.update(name.encode())
        h.update(c.encode())
    assert overall_checksum({"b": "2", "a": "1"}) == h.hexdigest()


def test_group_request_from_json():
    from miles.engines.local.dist_update import GroupRequest

    body = {"master_address": "10.0.0.1", "master_port": "2345", "rank_offset": 1, "world_size": 2}
    assert GroupRequest.from_json(body) == GroupRequest("10.0.0.1", 2345, 1, 2, "weight_update_group", "gloo")
    with pytest.raises(ValueError, match=r"missing fields \['world_size'\]"):
        GroupRequest.from_json({k: v for k, v in body.items() if k != "world_size"})
    with pytest.raises(ValueError, match="master_port=True is not an integer"):
        GroupRequest.from_json({**body, "master_port": True})
