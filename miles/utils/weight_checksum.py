"""SGLang's weight checksums (sglang/srt/utils/weight_checker.py), shared by the engine and the trainer.

Per tensor: the first 8 bytes of the SHA-256 of its raw bytes (in the dtype it is stored in), as 16 hex digits.
Per engine rank: SHA-256 over the sorted (name, checksum) pairs.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Checksum of one tensor's raw bytes (a bf16 tensor and its fp32 copy differ)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).digest()[:8].hex()


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's `per_gpu_checksum` of a {name: checksum} map."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()
