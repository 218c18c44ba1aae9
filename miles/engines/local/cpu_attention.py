"""Decode attention of the embedded engine on CPU in float32, by a small C kernel (`csrc/decode_attention.c`).

A decode step attends one query per running request over that request's keys and values in the position-major
`KVPool`. As batched matmuls this is two tiny products per (request, KV head) — hundreds of BLAS calls per layer
that read the pool in short strided runs; the kernel reads each request's positions in tiles with its queries
(output accumulators) held in registers, about 2.5x faster (batch 64, 56 positions, 8 layers: 8.4 -> 3.3 ms per
decode step on one thread, and still ahead of the matmuls on two threads: 4.9-5.8 ms). The softmax between its
two passes stays torch's. Results agree with the matmul path to float32 rounding (the dot products sum in another
order), and a row's result never depends on the other rows of the batch.

The kernel is compiled on first use with the machine's C compiler (`$CC`, else `gcc`, else `cc`;
`-O3 -march=native`), once per model shape (KV heads, query heads per KV head, head dim), into a cache directory
(`$MILES_KERNEL_CACHE`, else `$XDG_CACHE_HOME/miles/kernels` or `~/.cache/miles/kernels`) keyed by the source,
the compiler, the flags, the shape and the CPU, so later engines load it in milliseconds. Without a compiler,
when compiling fails, or for a head dim that is not a multiple of 8, `load_decode_attention` says why in a
warning and returns None: the engine keeps the matmul path (`--no-cpu-decode-kernel` chooses it outright).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-Wno-psabi")
COMPILE_TIMEOUT_S = 120.0
# intra-op threads up to which the single-threaded kernel beats the matmul path (measured on 1 and 2)
MAX_THREADS = 2

_P = ctypes.c_void_p
_I = ctypes.c_int64


class DecodeAttention:
    """The compiled kernel for one shape: `kv_heads` KV heads, `group` query heads each, head dim `head_dim`."""

    def __init__(self, lib: ctypes.CDLL, path: Path, kv_heads: int, group: int, head_dim: int):
        self.path = path
        self.kv_heads, self.group, self.head_dim = kv_heads, group, head_dim
        self._scores = lib.miles_decode_scores
        self._values = lib.miles_decode_values
        for fn in (self._scores, self._values):
            fn.argtypes = [_P, _P, _P, _P, _I, _I, _I, _P]
            fn.restype = None

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        key_len: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one query per row. q: [rows, H, D]; keys, values: one layer of the pool,
        [capacity, num_slots, kv_heads, D]; slots, lengths: int64 [rows] (row i sees positions
        0 .. lengths[i] - 1 of slot slots[i]); key_len = max(lengths). Returns [rows, H * D]."""
        rows = q.shape[0]
        heads = self.kv_heads * self.group
        for name, pool in (("keys", keys), ("values", values)):
            # the kernel computes addresses from these: anything else would read the wrong memory
            expected = (
                pool.shape[1] * self.kv_heads * self.head_dim,
                self.kv_heads * self.head_dim,
                self.head_dim,
                1,
            )
            if (
                pool.dtype != torch.float32
                or pool.stride() != expected
                or pool.shape[2:] != (self.kv_heads, self.head_dim)
            ):
                raise ValueError(
                    f"decode attention kernel: {name} {tuple(pool.shape)} {pool.dtype} strides {pool.stride()} "
                    f"is not one layer of a float32 [capacity, slots, {self.kv_heads}, {self.head_dim}] pool"
                )
        if (
            q.shape[1:] != (heads, self.head_dim)
            or slots.dtype != torch.int64
            or lengths.dtype != torch.int64
        ):
            raise ValueError(
                f"decode attention kernel: q {tuple(q.shape)} (wants [rows, {heads}, {self.head_dim}]), "
                f"slots {slots.dtype}, lengths {lengths.dtype} (want int64)"
            )
        qs = (q * scale).contiguous()  # the matmul path scales q the same way, before the product
        slots, lengths = slots.contiguous(), lengths.contiguous()
        scores = torch.empty(key_len, rows, heads, dtype=torch.float32)
        stride = keys.stride(0)
        self._scores(
            qs.data_ptr(),
            keys.data_ptr(),
            slots.data_ptr(),
            lengths.data_ptr(),
            rows,
            key_len,
            stride,
            scores.data_ptr(),
        )
        probs = torch.softmax(scores, 0)
        out = torch.empty(rows, heads * self.head_dim, dtype=torch.float32)
        self._values(
            probs.data_ptr(),
            values.data_ptr(),
            slots.data_ptr(),
            lengths.data_ptr(),
            rows,
            key_len,
            stride,
            out.data_ptr(),
        )
        return out


def usable_now() -> bool:
    """Whether the kernel is the faster path at this process's intra-op thread count."""
    return torch.get_num_threads() <= MAX_THREADS


@functools.cache
def load_decode_attention(kv_heads: int, group: int, head_dim: int) -> DecodeAttention | None:
    """The kernel for this shape, compiled or taken from the cache; None (with a warning saying why) when it
    cannot be had."""
    try:
        return _load(kv_heads, group, head_dim)
    except _Unavailable as e:
        logger.warning(
            "embedded engine: CPU decode attention kernel not used (%s); decode attention runs as matmuls", e
        )
        return None


class _Unavailable(Exception):
    pass


def find_compiler() -> str | None:
    """The C compiler the kernel is built with: `$CC`, else `gcc`, else `cc` (a path), or None."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cache_dir() -> Path:
    root = os.environ.get("MILES_KERNEL_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "miles" / "kernels"


def _cpu_id() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags (Linux), else the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    seen = {
        ln.split(":", 1)[0].strip(): ln for ln in lines if ":" in ln and ln.split(":", 1)[0].strip() in keys
    }
    return platform.machine() + "\n" + "\n".join(seen[k] for k in sorted(seen))


def _load(kv_heads: int, group: int, head_dim: int) -> DecodeAttention:
    if head_dim % 8:
        raise _Unavailable(f"head dim {head_dim} is not a multiple of 8")
    cc = find_compiler()
    if cc is None:
        raise _Unavailable("no C compiler: set $CC or install gcc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _Unavailable(f"{cc} --version failed: {e}") from e
    defines = (f"-DMILES_KVH={kv_heads}", f"-DMILES_GRP={group}", f"-DMILES_D={head_dim}")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [source, cc.encode(), version.encode(), " ".join(FLAGS + defines).encode(), _cpu_id().encode()]
        )
    )
    target = _cache_dir() / f"decode_attention_{kv_heads}x{group}x{head_dim}_{key.hexdigest()[:16]}.so"
    if not target.exists():
        _compile(cc, defines, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise _Unavailable(f"cannot load {target}: {e}") from e
    shape = (ctypes.c_int64 * 3)()
    lib.miles_shape(shape)
    if tuple(shape) != (kv_heads, group, head_dim):
        raise _Unavailable(f"{target} was built for shape {tuple(shape)}, not {(kv_heads, group, head_dim)}")
    logger.info("embedded engine: CPU decode attention kernel %s", target)
    return DecodeAttention(lib, target, kv_heads, group, head_dim)


def _compile(cc: str, defines: tuple[str, ...], target: Path) -> None:
    """Compile into `target` atomically: a concurrent engine either finds the whole library or builds its own."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise _Unavailable(
            f"cannot write the kernel cache {target.parent} ({e}); set $MILES_KERNEL_CACHE"
        ) from e
    cmd = [cc, *FLAGS, *defines, str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise _Unavailable(
                f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise _Unavailable(f"`{' '.join(cmd)}` took over {COMPILE_TIMEOUT_S:.0f} s") from e
    except OSError as e:
        raise _Unavailable(f"`{' '.join(cmd)}`: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
