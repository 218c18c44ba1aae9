"""Which finished group the fully async trainer takes (issue 25): with a staleness bound, a group that must be
trained at this step is never left behind for later, shorter ones (it would go stale and be discarded); the
trainer waits for it while it still generates, unless the buffer is full."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from miles.rollout.async_buffer import ADMIT_VERSION
from miles.rollout.async_worker import GROUP_KEY, AsyncGenerationWorker, AsyncSettings
from miles.utils.types import Sample


def _worker(bound: int | None = 1, capacity: int = 4) -> AsyncGenerationWorker:
    settings = AsyncSettings(
        batch=2, group_size=2, max_concurrent_samples=8, capacity=capacity, max_staleness=bound, retry=True
    )
    worker = AsyncGenerationWorker(SimpleNamespace(), settings, start_version=5)
    worker.alive = lambda: True  # type: ignore[method-assign]  # no generation thread here
    return worker


def _group(c: int, version: int) -> list[Sample]:
    meta = {GROUP_KEY: c, ADMIT_VERSION: version}
    return [
        Sample(prompt=f"p{c}", index=j, weight_versions=[str(version)], metadata=dict(meta)) for j in range(2)
    ]


def _admit(worker: AsyncGenerationWorker, c: int, version: int) -> list[Sample]:
    """Group c admitted at `version`: known to the worker, not yet finished."""
    worker.fresh[c] = _group(c, version)
    worker.admit_at[c] = version
    return _group(c, version)


def _keys(kept: list[list[Sample]]) -> list[int]:
    return [g[0].metadata[GROUP_KEY] for g in kept]


def _late_due_group() -> AsyncGenerationWorker:
    """Bound 1, step 5: groups 2 and 3 (admitted at 5) are buffered; group 0 (admitted at 4, due now) is put
    0.3 s later."""
    worker = _worker()
    late = _admit(worker, 0, 4)
    for c in (2, 3):
        worker.buffer.put(_admit(worker, c, 5))
    threading.Timer(0.3, worker.buffer.put, (late,)).start()
    return worker


def test_the_trainer_waits_for_a_group_that_would_go_stale():
    """Bound 1, step 5: group 0 (admitted at 4) is still generating and must be trained now; groups 2 and 3
    (admitted at 5) finished first. The batch is 2 and 3 would take them both and discard 0 a step later; it
    takes 2 and waits for 0 instead."""
    worker = _late_due_group()
    kept, metrics = worker.take_batch(5, timeout=10)
    assert _keys(kept) == [0, 2]
    assert metrics["async/retried_groups"] == 0 and metrics["async/staleness_max"] == 1
    assert _keys([worker.buffer.take(0)]) == [3]


def test_buffered_groups_due_now_go_first_and_without_a_bound_finish_order_holds():
    """Group 4 (admitted at 4) finished last but is due at step 5: taken before the fresher ones. Without a
    bound nothing is due: first finished, first taken."""
    for bound, want in ((1, [1, 4]), (None, [1, 2])):
        worker = _worker(bound)
        for c, v in ((1, 5), (2, 5), (4, 4)):
            worker.buffer.put(_admit(worker, c, v))
        kept, _ = worker.take_batch(5, timeout=1)
        assert _keys(kept) == want, bound


def test_a_full_buffer_is_taken_from_and_a_filtered_group_is_not_waited_for():
    """A group that must go now may be waiting for room in a full buffer: the trainer then takes what is
    buffered. A due group that the filter drops (it leaves the worker without a put) stops the wait."""
    worker = _worker(capacity=2)
    late = _admit(worker, 0, 4)
    _admit(worker, 9, 4)  # two due groups in flight, as many as the batch needs: waited for, unless full
    for c in (2, 3):
        worker.buffer.put(_admit(worker, c, 5))
    threading.Thread(target=worker.buffer.put, args=(late,)).start()  # blocks until the trainer makes room
    kept, _ = worker.take_batch(5, timeout=10)
    assert _keys(kept) == [0, 2]

    worker = _worker()
    _admit(worker, 0, 4)
    for c in (2, 3):
        worker.buffer.put(_admit(worker, c, 5))

    def filtered() -> None:
        with worker._lock:
            worker.fresh.pop(0), worker.admit_at.pop(0)
        worker.buffer.poke()

    threading.Timer(0.3, filtered).start()
    kept, _ = worker.take_batch(5, timeout=10)
    assert _keys(kept) == [2, 3]


def test_the_wait_for_a_due_group_is_timed():
    """timing/async_worker/wait_for_due_s: the trainer's wait for a due group while others were buffered (the
    cost of not discarding it); 0 when nothing had to be waited for."""
    worker = _late_due_group()
    _, metrics = worker.take_batch(5, timeout=10)
    assert 0.2 < metrics["timing/async_worker/wait_for_due_s"] < 5
    worker.buffer.put(_admit(worker, 4, 6))
    _, metrics = worker.take_batch(6, timeout=1)
    assert metrics["timing/async_worker/wait_for_due_s"] == 0.0
