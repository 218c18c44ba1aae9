"""The (dp, cp, tp) arithmetic of the training ranks, in one torch-free place: configuration validation, the driver's
train group and every training rank (`miles.backends.fsdp_utils.parallel`) use it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the row-major (dp, cp, tp) mesh (tp innermost); validated at construction.
    ``dp_size = world_size // (cp_size * tp_size)``; the ``cp_size * tp_size`` consecutive ranks of one data-parallel
    replica see the same samples."""

    world_size: int
    cp_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: must be >= 1")
        if self.cp_size < 1:
            raise ValueError(f"--context-parallel-size={self.cp_size}: must be >= 1")
        if self.tp_size < 1:
            raise ValueError(f"--tensor-model-parallel-size={self.tp_size}: must be >= 1")
        if self.world_size % self.cp_size != 0:
            raise ValueError(
                f"--context-parallel-size={self.cp_size} must divide the number of training ranks "
                f"(world_size={self.world_size})"
            )
        if self.world_size % (self.cp_size * self.tp_size) != 0:
            raise ValueError(
                f"--tensor-model-parallel-size={self.tp_size} must divide the number of training ranks per "
                f"context-parallel group (world_size={self.world_size} / cp {self.cp_size})"
            )

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica (cp * tp): they train on the same samples."""
        return self.cp_size * self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.replica_size

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of a global rank on the row-major (dp, cp, tp) mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}: must be in [0, {self.world_size})")
        return rank // self.replica_size, (rank // self.tp_size) % self.cp_size

    def tp_rank(self, rank: int) -> int:
        """The tensor-parallel rank of a global rank (tp is the innermost mesh dimension)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}: must be in [0, {self.world_size})")
        return rank % self.tp_size
