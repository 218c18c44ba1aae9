"""Tensor handles for weight refit over HTTP.

Matches SGLang's `MultiprocessingSerializer`: a list of (name, tensor) is pickled with torch's ForkingPickler,
which turns CUDA tensors into CUDA-IPC handles and shared-memory CPU tensors into shared-memory handles, then
base64-encoded so it can travel in a JSON body (`serialized_named_tensors`). Nothing is copied through HTTP but
the handles; the receiver maps the same memory. The sender must keep the tensors alive until the receiver has
answered.

Two SGLang rules carry over (sglang/srt/utils/patch_torch.py and sglang/srt/utils/common.py):

- **Devices travel as UUIDs.** A CUDA handle names its device by the sender's local index, which is another GPU
  in a receiver with a different `CUDA_VISIBLE_DEVICES`. Both sides therefore patch torch's reductions: the sender
  writes the device's UUID into the rebuild arguments (position 6), the receiver maps it back to its own index
  (an int is taken as is). The sender keeps torch's own `rebuild_cuda_tensor` as the pickled rebuild function,
  so SGLang's safe unpickler (which allows exactly that name) accepts the payload.
- **Unpickling is restricted** to containers, dtypes and torch's tensor/storage rebuild functions: a payload that
  names anything else raises `PayloadError` instead of running code.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
from torch.multiprocessing import reductions

_SHARING_STRATEGY = "file_system"  # shm by name: works between unrelated processes (no fd passing)
_DEVICE_ARG = 6  # index of the device in rebuild_cuda_tensor's arguments (stable across torch releases)


class PayloadError(ValueError):
    """A `serialized_named_tensors` entry that is not valid base64 or not an allowed pickle."""


def device_to_uuid(device: int) -> str:
    """The UUID of CUDA device `device` (as SGLang's patch writes it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def device_from_uuid(device: int | str) -> int:
    """This process's index of the device named by `device` (a UUID string, or already an index)."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if device_to_uuid(index) == device:
            return index
    raise PayloadError(f"no visible CUDA device has uuid {device!r} (CUDA_VISIBLE_DEVICES differs?)")


def with_device_uuid(args: tuple) -> tuple:
    """Rebuild arguments of a CUDA handle with the device index replaced by its UUID."""
    return (*args[:_DEVICE_ARG], device_to_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])


def with_device_index(args: tuple) -> tuple:
    """Rebuild arguments with a UUID (or index) replaced by this process's device index."""
    return (*args[:_DEVICE_ARG], device_from_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])


def _reduce_tensor_with_uuid(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[object, ...]]:
    fn, args = reductions._miles_reduce_tensor_original(tensor)
    if tensor.is_cuda and fn in (
        _rebuild_cuda_tensor_from_uuid,
        reductions._miles_rebuild_cuda_tensor_original,
    ):
        args = with_device_uuid(args)
    return fn, args


def _rebuild_cuda_tensor_from_uuid(*args: object) -> torch.Tensor:
    return reductions._miles_rebuild_cuda_tensor_original(*with_device_index(args))


_rebuild_cuda_tensor_from_uuid.__module__ = reductions.__name__  # pickled under torch's own name
_rebuild_cuda_tensor_from_uuid.__qualname__ = "rebuild_cuda_tensor"


def patch_torch_reductions() -> None:
    """Install the UUID reductions on both directions (idempotent)."""
    if hasattr(reductions, "_miles_reduce_tensor_original"):
        return
    reductions._miles_reduce_tensor_original = reductions.reduce_tensor
    reductions._miles_rebuild_cuda_tensor_original = reductions.rebuild_cuda_tensor
    reductions.reduce_tensor = _reduce_tensor_with_uuid
    reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_from_uuid
    reductions.init_reductions()


def _ensure_strategy() -> None:
    patch_torch_reductions()
    if mp.get_sharing_strategy() != _SHARING_STRATEGY:
        mp.set_sharing_strategy(_SHARING_STRATEGY)


def serialize(obj: object) -> str:
    """Pickle `obj` with tensor handles (CPU tensors are moved to shared memory) and base64-encode it."""
    from multiprocessing.reduction import ForkingPickler

    _ensure_strategy()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_ALLOWED_MODULES = {
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes", "slice"},
    "collections": {"OrderedDict"},
    "copyreg": {"__newobj__"},
    "torch": {"Size", "device", "dtype", "Tensor", "UntypedStorage", "FloatStorage", "BFloat16Storage",
              "HalfStorage", "DoubleStorage", "LongStorage", "IntStorage", "ByteStorage", "BoolStorage"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter"},
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd",
                                         "rebuild_storage_filename", "rebuild_storage_empty",
                                         "rebuild_typed_storage", "rebuild_typed_storage_child"},
    "multiprocessing.reduction": {"_rebuild_partial"},
    "multiprocessing.resource_sharer": {"DupFd"},
}  # fmt: skip


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if name in _ALLOWED_MODULES.get(module, ()) or (module == "torch" and _is_dtype(name)):
            return super().find_class(module, name)
        raise PayloadError(f"pickle names {module}.{name}, which a tensor payload may not contain")


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def deserialize(data: str | bytes) -> object:
    """Inverse of `serialize`, restricted to tensor payloads; PayloadError for anything else."""
    _ensure_strategy()
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    except (binascii.Error, ValueError) as e:
        raise PayloadError(f"not base64: {e}") from None
    try:
        return _SafeUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbage pickles raise many types
        raise PayloadError(f"not a tensor pickle: {type(e).__name__}: {e}") from None


def share_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Make CPU tensors shareable (move into shared memory); CUDA tensors are shared through IPC as they are."""
    out = []
    for name, t in named_tensors:
        t = t.detach()
        if t.device.type == "cpu":
            t = t.contiguous().clone().share_memory_() if not t.is_shared() else t
        out.append((name, t))
    return out
