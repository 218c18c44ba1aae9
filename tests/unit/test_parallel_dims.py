"""ParallelDims: the torch-free (dp, cp) arithmetic that validation, the driver's train group and the trainer share."""

from __future__ import annotations

import pytest

from miles.utils.parallel_dims import ParallelDims


def test_row_major_coords_and_dp_size():
    dims = ParallelDims(world_size=6, cp_size=2)
    assert dims.dp_size == 3
    assert [dims.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert ParallelDims(world_size=4).coords(3) == (3, 0)


@pytest.mark.parametrize(
    ("world", "cp", "message"),
    [
        (0, 1, "world_size=0"),
        (4, 0, "--context-parallel-size=0"),
        (6, 4, "must divide the number of training ranks"),
    ],
)
def test_refuses_impossible_meshes(world, cp, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(world_size=world, cp_size=cp)


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match=r"rank=4: must be in \[0, 4\)"):
        ParallelDims(world_size=4, cp_size=2).coords(4)
