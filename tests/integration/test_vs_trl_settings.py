"""The two sides of scripts/bench/vs_trl.py run the same experiment: for every workload, TRL's effective settings
(read off a real `GRPOTrainer` built by `trl_child.py`, its generation config and its optimizer) equal miles'
(its config as `miles.train` parses `vs_trl.miles_command`), row by row of `bench_workloads.SETTING_ROWS`; and a
changed TRL setting shows up as a difference. Skips without the TRL venv (`bash scripts/trl-venv.sh`; fails under
CI=true, tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_workloads as bw  # noqa: E402
import vs_trl  # noqa: E402

TRL_VENV = vs_trl.installed_trl_venv()
pytestmark = pytest.mark.side_venv(
    Path(os.environ.get("MILES_TRL_VENV", ROOT / ".venv-trl")), vs_trl.STAMP, "bash scripts/trl-venv.sh"
)


def _both(w: bw.Workload, work: Path, override: dict[str, object]) -> tuple[dict[str, str], dict[str, str]]:
    """(miles, TRL) settings of workload `w` with seed 1; `override` changes TRL's GRPOConfig."""
    model = bw.build_model(w, work / "model")
    data = bw.write_rows(bw.make_rows(w, 64, seed=0), work / "prompts.jsonl")
    miles = vs_trl.miles_settings(vs_trl.miles_command(w, model, data, work / "run", "colocate2", 1), model)
    assert TRL_VENV is not None
    cmd = [
        str(vs_trl.trl_python(TRL_VENV)), str(vs_trl.HERE / "trl_child.py"), "--model", str(model),
        "--data", str(data), "--spec", json.dumps(dataclasses.asdict(w)), "--out", str(work / "trl"),
        "--seed", "1", "--settings-only", "--override", json.dumps(override),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=vs_trl.base_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    events = [e for e in vs_trl.trl_events(out.stdout.splitlines()) if e["event"] == "settings"]
    assert len(events) == 1, out.stdout[-3000:]
    return miles, events[0]["settings"]


@pytest.mark.parametrize("name", sorted(bw.WORKLOADS))
def test_trl_and_miles_run_the_same_experiment(name: str, tmp_path: Path) -> None:
    w = bw.get_workload(name).quick()
    miles, trl = _both(w, tmp_path, {})
    assert set(trl) == set(bw.SETTING_ROWS) - {"lr logged per step"}
    assert bw.settings_mismatches(miles, trl) == []  # "lr logged per step" is in neither: a real run's logs
    print("\n".join(bw.format_settings(miles, trl)))


def test_a_changed_trl_setting_is_reported(tmp_path: Path) -> None:
    w = bw.get_workload("quickstart").quick()
    override = {"top_k": 50, "loss_type": "dapo", "weight_decay": 0.1, "warmup_steps": 2, "beta": 0.04}
    miles, trl = _both(w, tmp_path, override)
    assert bw.settings_mismatches(miles, trl) == [
        "sampling", "policy loss", "KL", "optimizer", "lr schedule"
    ]  # fmt: skip
    assert "top-k 50" in trl["sampling"] and trl["KL"] == "loss k3 x0.04"
    assert trl["optimizer"].endswith("weight decay 0.1 (some parameters 0)")
    assert trl["policy loss"] == "PPO clip 0.2/0.28, TRL loss_type dapo"
