"""Progress bars that stay quiet where nobody watches.

The driver decides once whether bars are wanted (`--progress`, the default, and stderr is a terminal) and passes
the decision to every process as MILES_PROGRESS=1 (`progress_env`). Code anywhere then asks for a bar:

    with progress_bar(total=len(packs), desc=f"train {rollout_id}", unit="mb", enabled=rank == 0) as bar:
        for pack in packs:
            ...
            bar.update()

and gets a no-op object when bars are off. When Ray is initialised (the driver and every actor) the bar is Ray's
`tqdm_ray`: actors send their bar state to the driver, which owns the terminal and draws all bars there (and
keeps `print` from tearing them). Without Ray it is a plain tqdm bar on stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Protocol, TypeVar

ENV = "MILES_PROGRESS"
_T = TypeVar("_T")


def progress_wanted(requested: bool, stream: IO[str] | None = None) -> bool:
    """Bars are drawn only when asked for (`--progress`) and `stream` (default: stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(requested) and bool(isatty and isatty())


def progress_env(on: bool) -> dict[str, str]:
    """Record the decision in this process's environment and return it for other processes' environments."""
    os.environ[ENV] = "1" if on else "0"
    return {ENV: os.environ[ENV]}


def progress_enabled() -> bool:
    """Whether the driver asked for bars (MILES_PROGRESS=1 in this process's environment)."""
    return os.environ.get(ENV) == "1"


class ProgressBar(Protocol):
    """What callers of a bar use (tqdm, tqdm_ray and the no-op bar all have it)."""

    def update(self, n: int = 1) -> None: ...

    def set_description(self, desc: str) -> None: ...

    def close(self) -> None: ...


class _NoBar:
    """The bar when bars are off: accepts every call, draws nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Bar(_NoBar):
    """A drawn bar (tqdm or tqdm_ray) behind the same small interface."""

    def __init__(self, bar: ProgressBar) -> None:
        self._bar = bar

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def set_description(self, desc: str) -> None:
        self._bar.set_description(desc)

    def close(self) -> None:
        self._bar.close()


def _ray_running() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


def progress_bar(
    total: int | None,
    desc: str,
    unit: str = "it",
    enabled: bool = True,
    file: IO[str] | None = None,
) -> _NoBar:
    """A bar counting to `total`, drawn only when `enabled` and bars are on (MILES_PROGRESS=1); else a no-op.

    `file` (tests) forces a plain tqdm bar on that stream, whatever the environment says."""
    if file is None and not (enabled and progress_enabled()):
        return _NoBar()
    if file is None and _ray_running():
        from ray.experimental.tqdm_ray import tqdm as ray_tqdm

        return _Bar(ray_tqdm(total=total, desc=desc, unit=unit))
    from tqdm import tqdm

    return _Bar(
        tqdm(total=total, desc=desc, unit=unit, file=file or sys.stderr, dynamic_ncols=True, leave=False)
    )


def track(
    items: Iterable[_T], total: int | None, desc: str, unit: str = "it", enabled: bool = True
) -> Iterator[_T]:
    """Iterate `items`, advancing a `progress_bar` by one per item (the one-line hook for a loop)."""
    with progress_bar(total, desc, unit, enabled) as bar:
        for item in items:
            yield item
            bar.update()
