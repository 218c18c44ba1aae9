"""The window refit's agreement through per-rank flags in shared memory (`HostFlags`): every rank learns whether
any failed, rounds stay in step after a failure, a missing rank is named after the timeout, and a file of the
wrong size is refused. Ranks are threads here (the flags are plain shared memory; processes see the same file)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from miles.refit.window import FLAGS_PREFIX, HostFlags


def _ranks(world: int, tmp_path) -> list[HostFlags]:
    owner = HostFlags(0, world, directory=str(tmp_path))
    return [owner, *(HostFlags(r, world, path=owner.path) for r in range(1, world))]


def _round(flags: list[HostFlags], failed: list[bool]) -> list[bool]:
    with ThreadPoolExecutor(len(flags)) as pool:
        return list(pool.map(lambda i: flags[i].agree(failed[i], timeout_s=30), range(len(flags))))


def test_every_rank_learns_any_failure_and_rounds_stay_in_step(tmp_path):
    flags = _ranks(3, tmp_path)
    assert os.path.basename(flags[0].path).startswith(FLAGS_PREFIX)
    assert _round(flags, [False, False, False]) == [False] * 3
    assert _round(flags, [False, True, False]) == [True] * 3
    assert _round(flags, [False, False, False]) == [False] * 3  # the failed round left nothing behind
    assert _round(flags, [True, False, True]) == [True] * 3
    for _ in range(20):  # ranks racing ahead into the next round do not confuse slower ones
        assert _round(flags, [False, False, False]) == [False] * 3
    path = flags[0].path
    for f in flags:
        f.close()
    assert not os.path.exists(path)  # the owner unlinks its file


def test_a_rank_that_never_arrives_is_named(tmp_path):
    flags = _ranks(2, tmp_path)
    with pytest.raises(TimeoutError, match=r"agreement 1: training ranks \[1\] did not arrive"):
        flags[0].agree(False, timeout_s=0.05)


def test_flags_of_another_world_size_are_refused(tmp_path):
    owner = HostFlags(0, 2, directory=str(tmp_path))
    with pytest.raises(ValueError, match="16 bytes, 3 ranks need 8 each"):
        HostFlags(1, 3, path=owner.path)
