"""report.png and run overlays from metrics.jsonl."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib")

from miles.tools import plot  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(path, n: int, offset: float = 0.0, duplicate: int | None = None) -> None:
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i in range(n):
            rec = {
                "step": i,
                "rollout/raw_reward": offset + i / n,
                "rollout/response_len": 2.0,
                "train/loss": 0.01 * (-1) ** i,
                "train/ppo_kl": 0.0 if i == 0 else -1e-4,
                "train/train_rollout_logprob_abs_diff": "nan" if i == 1 else 1e-7,
                "timing/rollout": 1.0,
                "timing/train": 2.0,
                "timing/refit": 0.5,
            }
            if i % 5 == 4:
                rec["eval/echo"] = 0.5
            f.write(json.dumps(rec) + "\n")
        if duplicate is not None:  # an older metrics file written before resumes dropped repeated steps
            f.write(json.dumps({"step": duplicate, "rollout/raw_reward": 9.0}) + "\n")


def test_report_of_one_run(tmp_path):
    run = tmp_path / "run-a"
    _write_run(run, 30, duplicate=3)
    loaded = plot.load_run(run)
    assert [r["step"] for r in loaded.rows] == list(range(30))
    assert loaded.rows[3]["rollout/raw_reward"] == 9.0  # the last record of a step wins
    assert loaded.keys("eval/*") == ["eval/echo"]
    assert math.isnan(loaded.values("train/train_rollout_logprob_abs_diff")[1])
    out = plot.write_report(run)
    assert out == run / "report.png" and out.read_bytes()[:8] == PNG and out.stat().st_size > 20_000
    assert not (run / "report.png.tmp").exists()


def test_overlay_cli_and_errors(tmp_path, capsys):
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    _write_run(a, 12)
    _write_run(b, 8, offset=0.2)
    out = tmp_path / "both.png"
    assert plot.main([str(a), str(b), "--out", str(out), "--smooth", "3"]) == 0
    assert out.read_bytes()[:8] == PNG
    assert plot.main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert plot.write_report(empty) is None and plot.write_report(tmp_path / "nothing") is None


def test_smooth_is_a_trailing_mean_that_keeps_gaps():
    values = [1.0, 3.0, math.nan, 5.0, 7.0]
    got = plot.smooth(values, 2)
    assert got[:2] == [1.0, 2.0] and math.isnan(got[2]) and got[3:] == [4.0, 6.0]
