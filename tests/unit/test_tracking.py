"""metrics.jsonl, TensorBoard events and the resume rule: a step logged before a crash and again after the resume
appears once, with the resumed run's values."""

from __future__ import annotations

import json

import pytest

from miles.utils.tracking import Tracker, read_metrics


def _steps(path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(path)]


def test_resume_drops_steps_at_or_after_the_resumed_one(tmp_path):
    t = Tracker(tmp_path)
    for step in range(4):
        t.log(step, {"train/loss": float(step), "tag": "first"})
    t.close()
    t = Tracker(tmp_path)
    t.resume_at(2)
    assert _steps(t.metrics_path) == [(0, 0.0), (1, 1.0)]
    for step in (2, 3, 4):
        t.log(step, {"train/loss": 10.0 + step})
    t.close()
    assert _steps(tmp_path / "metrics.jsonl") == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # the rewrite left no temp file


def test_non_finite_values_and_a_torn_last_line(tmp_path):
    t = Tracker(tmp_path)
    t.log(0, {"train/loss": float("nan"), "perf/x": float("inf")})
    t.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "train/lo')  # a crash in the middle of a write
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 0, "train/loss": "nan", "perf/x": "inf"}]
    t = Tracker(tmp_path)
    t.resume_at(1)  # drops the torn line too
    t.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 0


def test_tensorboard_scalars_use_the_metric_names_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(tmp_path, use_tensorboard=True)
    for step in range(3):
        t.log(step, {"rollout/raw_reward": 0.1 * step, "train/loss": float(step), "note": "text"})
    t.close()
    t = Tracker(tmp_path, use_tensorboard=True)
    t.resume_at(1)
    t.log(1, {"rollout/raw_reward": 0.9, "train/loss": 5.0})
    t.close()

    acc = EventAccumulator(str(t.tensorboard_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"rollout/raw_reward", "train/loss"}
    events = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(0, 0.0), (1, 5.0)]


def test_tensorboard_without_the_package_names_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tensorboard":
            raise ImportError("no tensorboard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="--use-tensorboard needs the `tensorboard` package"):
        Tracker(tmp_path, use_tensorboard=True)
