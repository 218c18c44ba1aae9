"""Giving freed host memory back to the OS (glibc's malloc keeps it otherwise).

torch's CPU allocator is plain malloc: tensors of up to 32 MB come from malloc's heaps, and what a phase frees there
stays mapped, counted in the process's RSS and PSS, until malloc happens to trim the top of a heap. A colocated
embedded engine that released its weights and KV cache before training would then still hold its generation's
leftovers at the trainers' peak. `trim()` (glibc's `malloc_trim(0)`) returns every free page of every arena; what
is in use is untouched, so no number changes. It costs a walk over the heaps (milliseconds) and fresh page faults
when the memory is used again. Outside glibc (macOS, musl) it does nothing.

Measured with `scripts/bench/pss_inventory.py` on `scripts/bench/vs_trl.py`'s compute workload: a released engine
holds ~350 MB instead of ~480 MB (imports and the model's modules are ~300 MB of it). The trainers do not trim
after their train call: they would hold ~0.55 GB instead of ~2 GB while the engines generate, but that phase is not
the run's peak, and each step would fault its activations in afresh (~1.5 GB per rank: ~0.5 s of system time
at the ~1.4 us per page fault measured on this machine).
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:  # this process's own symbols (libc's among them): no `find_library`, which runs ldconfig in a subprocess
        libc = ctypes.CDLL(None)
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
