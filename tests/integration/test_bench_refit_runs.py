"""scripts/bench/refit.py runs end to end on the quickstart model (one engine, one timed refit per transport, and
with the engines' release/resume and the per-part timeline):
the bench constructs the refit transports itself, so a change of their constructors must not break it unseen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "transport, extra",
    [("window", []), ("handles", []), ("window", ["--release-resume", "--timeline"])],
)
def test_refit_bench_runs(tmp_path: Path, transport: str, extra: list[str]) -> None:
    out = tmp_path / "refit.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench/refit.py", "--workload", "quickstart", "--repeats", "1",
         "--transport", transport, "--work-dir", str(tmp_path), "--out", str(out), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["result"]
    assert result["transport"] == transport and result["engines"] == 1
    assert len(result["refit_s"]) == 1 and result["refit_s"][0] > 0
    assert "refit / memcpy bandwidth" in proc.stdout
    if "--timeline" in extra:  # the ranks' parts of a refit: plan and copies, agreement, engine calls
        assert "rank 0 refit ms (median over 1): total " in proc.stdout and " http " in proc.stdout
