"""Request batching for the rollout's generation client (`miles.rollout.generate_client.GenerateClient`).

`generate` calls made under the same batch key (see `batching`; the stock rollout opens one per prompt group, or
one for all the groups it launches at once when it needs every one of them) within the same event-loop turn go out
as one SGLang batch request (`input_ids` a list of prompts, `sampling_params`, `rid` and `return_logprob` per
item; the answer is a list in the same order) and each caller gets its own item; with `per_engine`, as one batch
request per engine that may take one (the calls cut in arrival order into that many near-equal contiguous chunks,
`split_evenly`). SGLang answers a batch when all its items are done, so only requests that are awaited together
anyway share one. Calls outside `batching` go alone, and so does every call through the router, which takes no
batch form.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Batch:
    """The batch a `generate` call joins: its key and whether it is split over the engines."""

    key: object
    per_engine: bool  # split into one request per engine that may take one


_BATCH: contextvars.ContextVar[Batch | None] = contextvars.ContextVar("miles_engine_batch", default=None)


@contextlib.contextmanager
def batching(key: object, per_engine: bool = False) -> Iterator[None]:
    """`generate` calls made inside (including in tasks created inside) may share one batch request with the
    other calls under the same `key` issued in the same event-loop turn; with `per_engine`, one batch request
    per engine that may take one (the calls cut in arrival order into that many near-equal contiguous chunks)."""
    token = _BATCH.set(Batch(key, per_engine))
    try:
        yield
    finally:
        _BATCH.reset(token)


def current_batch() -> Batch | None:
    """The batch the calling code (or the task that created it) runs inside, None outside `batching`."""
    return _BATCH.get()


def batching_open() -> bool:
    """Whether the calling code (or the task that created it) runs inside `batching`."""
    return current_batch() is not None


def split_evenly(items: list[T], parts: int) -> list[list[T]]:
    """`items` in order, cut into min(parts, len(items)) contiguous chunks whose sizes differ by at most one."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out
