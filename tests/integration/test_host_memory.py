"""`miles.utils.host_memory.trim`: freed heap pages go back to the OS (glibc Linux), nothing in use is touched."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from miles.utils import host_memory

glibc = pytest.mark.skipif(host_memory._libc() is None, reason="needs glibc's malloc_trim")

# 160 MB in 64 KiB blocks (under malloc's mmap threshold, so they come from the heap), all freed but the last one,
# which pins the heap's top: malloc cannot shrink the heap by itself, only trim's madvise of free pages frees them
CHILD = textwrap.dedent(
    """
    import sys
    from miles.utils import host_memory

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    blocks = [bytearray(64 * 1024) for _ in range(2560)]
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])  # touch every page
    keep = blocks[-1]
    del blocks
    before = rss_mb()
    ran = host_memory.trim()
    after = rss_mb()
    assert keep[0] == ord("x")  # what is in use is intact
    print(ran, round(before), round(after))
    """
)


@glibc
def test_trim_returns_freed_heap_pages():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    ran, before, after = out.split()
    assert ran == "True"
    assert int(before) - int(after) > 100, (before, after)  # ~160 MB freed but held, then given back


def test_trim_is_a_noop_without_glibc(monkeypatch):
    monkeypatch.setattr(host_memory, "_libc", lambda: None)
    assert host_memory.trim() is False
