"""Wall-clock timings per phase, reported as `timing/<phase>` metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timer:
    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """Return and reset the accumulated times as `timing/<phase>` seconds."""
        out = {f"timing/{k}": v for k, v in self._totals.items()}
        self._totals.clear()
        return out
