"""Intra-op threads of CPU training ranks: the cores shared out, never below one."""

from __future__ import annotations

import os
from types import SimpleNamespace

from miles.ray import utils


def test_cores_are_shared_by_the_ranks_and_the_concurrent_engines(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert utils.cpu_trainer_threads(1, 0) == 8
    assert utils.cpu_trainer_threads(2, 0) == 4  # colocated: the engines sleep while the ranks train
    assert utils.cpu_trainer_threads(2, 2) == 3  # disaggregated: one core per engine
    assert utils.cpu_trainer_threads(3, 0) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert utils.cpu_trainer_threads(2, 0) == 1  # the quickstart: as Ray's default, one each
    assert utils.cpu_trainer_threads(1, 0) == 2
    assert utils.cpu_trainer_threads(2, 2) == 1  # oversubscribed: still one


def test_fully_async_keeps_the_engines_cores_for_the_engines(monkeypatch):
    """Disaggregated --fully-async on CPU: the engines generate while the rank trains, so the rank takes the cores
    the engines leave (MILES_CPU_TRAIN_THREADS, which FSDP's set_cpu_threads honours); the other drivers and
    bound 0 keep sharing every core out (the engines wait while the ranks train)."""

    from miles.ray import setup

    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
    placement = SimpleNamespace(use_gpu=False, engine_bundles=[0])

    def env(fully_async: bool, colocate: bool = False, bound: int | None = None) -> dict[str, str]:
        rollout = SimpleNamespace(fully_async=fully_async, max_weight_staleness=bound)
        cfg = SimpleNamespace(cluster=SimpleNamespace(colocate=colocate), rollout=rollout)
        return setup._cpu_threads_env(cfg, placement, 1)

    assert env(True) == env(True, bound=1) == {"OMP_NUM_THREADS": "1", "MILES_CPU_TRAIN_THREADS": "1"}
    assert env(True, bound=0) == {"OMP_NUM_THREADS": "1"}  # bound 0: nothing generates during a step
    assert env(False) == {"OMP_NUM_THREADS": "1"}
    assert env(False, colocate=True) == {"OMP_NUM_THREADS": "2"}


def test_one_step_off_keeps_the_engines_cores_for_the_engines(monkeypatch):
    """miles.train_async without --fully-async generates rollout k + 1 while the rank trains on k: its main
    marks its process (OVERLAP_ENV, restored after), and the setup then keeps the engines' cores for them as
    with --fully-async; miles.train's process has no mark."""
    from miles import train_async
    from miles.ray import setup

    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
    placement = SimpleNamespace(use_gpu=False, engine_bundles=[0])
    rollout = SimpleNamespace(fully_async=False, max_weight_staleness=None)
    cfg = SimpleNamespace(cluster=SimpleNamespace(colocate=False), rollout=rollout)
    monkeypatch.delenv(train_async.OVERLAP_ENV, raising=False)
    seen = {}

    def fake_run_driver(argv, loop, prog, refuse):
        seen["env"] = setup._cpu_threads_env(cfg, placement, 1)
        return 0

    monkeypatch.setattr(train_async, "run_driver", fake_run_driver)
    assert train_async.main([]) == 0
    assert seen["env"] == {"OMP_NUM_THREADS": "1", "MILES_CPU_TRAIN_THREADS": "1"}
    assert train_async.OVERLAP_ENV not in os.environ  # restored
    assert setup._cpu_threads_env(cfg, placement, 1) == {"OMP_NUM_THREADS": "1"}  # miles.train


def test_set_cpu_threads_honours_the_drivers_count(monkeypatch):
    import torch

    from miles.backends.fsdp_utils import state

    ps = SimpleNamespace(is_cuda=False, world_size=1)
    monkeypatch.setattr(state.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(state.dist, "get_rank", lambda: 1)
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(state.CPU_TRAIN_THREADS_ENV, "1")
        state.set_cpu_threads(ps)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv(state.CPU_TRAIN_THREADS_ENV)
        state.set_cpu_threads(ps)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
