"""SGLang's weight checksums (sglang/srt/utils/weight_checker.py), shared by the engine and the trainer.

Per tensor, 16 hex digits of a 64-bit hash of its raw bytes (in the dtype it is stored in), by the device the
engine holds it on (SGLang's ``tensor_hash``, sglang/srt/managers/mm_utils.py):

- CPU (``"sha256"``): the first 8 bytes of the SHA-256 of the bytes;
- CUDA (``"cuda"``): SGLang's tile hash (sglang/kernels/ops/memory/gpu_tensor_hash.py, a triton kernel),
  re-derived here in plain torch (`cuda_tensor_hash`) so a trainer computes it on any device.

Per engine rank: SHA-256 over the sorted (name, checksum) pairs (`overall_checksum`).
"""

from __future__ import annotations

import hashlib

import torch

HASH_KINDS = ("sha256", "cuda")

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
# The tile hash's constants (facts of SGLang's definition): murmur3's fmix32 multipliers, two position
# multipliers, the seed (pi's first digits) and the tile of 8192 32-bit words.
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_POS_A, _POS_B = 0x27D4EB2D, 0x165667B1
_SEED = 0x243F6A88
_SEED1 = _SEED & _M32
_SEED2 = ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
_TILE = 8192
_CHUNK_TILES = 256  # tiles hashed per step: bounds the int64 temporaries to 2M words (16 MiB each)


def tensor_checksum(tensor: torch.Tensor, kind: str = "sha256") -> str:
    """Checksum of one tensor's raw bytes as an engine on ``kind``'s device reports it (a bf16 tensor and its
    fp32 copy differ)."""
    if kind == "cuda":
        return f"{cuda_tensor_hash(tensor):016x}"
    if kind != "sha256":
        raise ValueError(f"checksum kind {kind!r}: allowed {list(HASH_KINDS)}")
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).digest()[:8].hex()


def device_hash_kind(device: torch.device | str) -> str:
    """The checksum an engine computes for tensors on ``device``: SGLang's tile hash on CUDA, else SHA-256."""
    return "cuda" if str(device).startswith("cuda") else "sha256"


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 tensors of 32-bit values, without int64 overflow (16-bit halves)."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_C2)
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (zero-padded to a multiple of 4) as little-endian 32-bit words, in int64."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32).to(torch.int64) & _M32


@torch.no_grad()
def cuda_tensor_hash(tensor: torch.Tensor) -> int:
    """SGLang's CUDA tensor hash as an int, computed with torch on the tensor's own device.

    Definition: the bytes, zero-padded to whole words, are words ``w[i]`` (uint32, little-endian), ``n`` of
    them; all arithmetic is mod 2**32. Word ``i`` gives ``k1 = fmix32(w[i] ^ p1(i))`` with
    ``p1(i) = (i * POS_A + seed1) ^ rotl32(i, 15)`` and ``k2`` likewise with ``POS_B``, ``seed2`` and
    ``rotl32(i, 13)``. Tile ``t`` (words ``[8192 t, 8192 (t+1))``) sums its ``k1`` into ``h1`` and its ``k2`` into
    ``h2``, xors both with the padded byte count ``4 n`` and finalizes each with ``fmix32``; its value is
    ``h1 << 32 | h2``. The tiles' values are summed mod 2**64 and finalized with splitmix64's mixer. An empty
    tensor hashes to 0."""
    words = _words(tensor)
    n = words.numel()
    if n == 0:
        return 0
    nbytes = (4 * n) & _M32
    sum1 = sum2 = 0
    step = _TILE * _CHUNK_TILES
    for start in range(0, n, step):
        w = words[start : start + step]
        i = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device) & _M32
        p1 = ((_mul32(i, _POS_A) + _SEED1) & _M32) ^ _rotl32(i, 15)
        p2 = ((_mul32(i, _POS_B) + _SEED2) & _M32) ^ _rotl32(i, 13)
        k = torch.stack([_fmix32(w ^ p1), _fmix32(w ^ p2)])  # (2, words)
        tail = -w.numel() % _TILE
        if tail:  # words past the end count as nothing (masked), not as zero words
            k = torch.cat([k, k.new_zeros(2, tail)], dim=1)
        h = _fmix32((k.view(2, -1, _TILE).sum(dim=2) & _M32) ^ nbytes)  # (2, tiles)
        s1, s2 = h.sum(dim=1).tolist()
        sum1, sum2 = sum1 + s1, sum2 + s2
    return _splitmix64((sum1 << 32) + sum2)


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's `per_gpu_checksum` of a {name: checksum} map."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()
