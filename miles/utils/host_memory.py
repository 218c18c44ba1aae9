"""Giving freed host memory back to the OS (glibc's malloc keeps it otherwise).

torch's CPU allocator is plain malloc: tensors of up to 32 MB come from malloc's heaps (one per arena, and a busy
process with many threads has several), and what a phase frees there stays mapped, counted in the process's RSS
and PSS, until malloc happens to trim the top of a heap. A colocated engine that released its weights and KV cache
before training, or a trainer done with a step's activations, then still holds the pages at the peak of the other
phase. `trim()` (glibc's `malloc_trim(0)`) returns every free page of every arena; what is in use is untouched, so
no number changes. It costs a walk over the heaps (milliseconds) and fresh page faults when the memory is used
again. Outside glibc (macOS, musl) it does nothing.

Measured on `scripts/bench/vs_trl.py`'s compute workload (`scripts/bench/pss_inventory.py`): a trainer rank holds
~2.2 GB through a step and ~0.55 GB after its trim (it kept ~2 GB until the next step before); a released engine
~350 MB (imports and the built model's modules: ~300 MB of it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim() -> bool:
    """Return the free pages of every malloc arena to the OS; True when glibc's `malloc_trim` ran."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
