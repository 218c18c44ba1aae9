"""Intra-op threads of CPU training ranks: the cores shared out, never below one."""

from __future__ import annotations

import os

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
