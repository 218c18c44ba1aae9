"""Wall-clock timings per phase, reported as `timing/<phase>` metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timer:
    def __init__(self) -> None:
        self._totals: dict[str, float] = {}
        self._open: list[str] = []
        self._raised_in: str | None = None

    @property
    def current(self) -> str | None:
        """The innermost phase in progress, or the innermost one an exception (Ctrl-C) left; None between
        phases."""
        return self._open[-1] if self._open else self._raised_in

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        if not self._open:
            self._raised_in = None
        self._open.append(name)
        try:
            yield
        except BaseException:
            self._raised_in = self._raised_in or name
            raise
        finally:
            self._open.pop()
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count `seconds` of phase `source` under `target` instead (a part of the phase that another process timed:
        the refit at the end of the train call), clamped to what `source` has (the clocks are different ones)."""
        seconds = min(max(seconds, 0.0), self._totals.get(source, 0.0))
        self._totals[source] = self._totals.get(source, 0.0) - seconds
        self._totals[target] = self._totals.get(target, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """Return and reset the accumulated times as `timing/<phase>` seconds."""
        out = {f"timing/{k}": v for k, v in self._totals.items()}
        self._totals.clear()
        return out
