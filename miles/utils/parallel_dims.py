"""The (dp, cp) arithmetic of the training ranks, in one torch-free place: configuration validation, the driver's
train group and every training rank (`miles.backends.fsdp_utils.parallel`) use it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the (dp, cp) mesh; validated at construction. ``dp_size = world_size // cp_size``."""

    world_size: int
    cp_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: must be >= 1")
        if self.cp_size < 1:
            raise ValueError(f"--context-parallel-size={self.cp_size}: must be >= 1")
        if self.world_size % self.cp_size != 0:
            raise ValueError(
                f"--context-parallel-size={self.cp_size} must divide the number of training ranks "
                f"(world_size={self.world_size})"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of a global rank on the row-major (dp, cp) mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}: must be in [0, {self.world_size})")
        return rank // self.cp_size, rank % self.cp_size
