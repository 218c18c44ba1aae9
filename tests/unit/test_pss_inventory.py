"""scripts/bench/pss_inventory.py's pure parts: the smaps_rollup fields it reads and the workload command lines it
runs (the same as vs_trl.py's). The inventory itself is not run here."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import pss_inventory  # noqa: E402
import vs_trl  # noqa: E402

ROLLUP = """55d0c0a00000-7ffd6a3f2000 ---p 00000000 00:00 0                          [rollup]
Rss:              646208 kB
Pss:              470356 kB
Pss_Dirty:        460185 kB
Pss_Anon:         419128 kB
Pss_File:          10170 kB
Pss_Shmem:         41057 kB
"""


def test_parse_rollup_reads_pss_and_its_parts() -> None:
    r = pss_inventory.parse_rollup(ROLLUP)
    assert r == {"Pss": 470356, "Pss_Anon": 419128, "Pss_File": 10170, "Pss_Shmem": 41057}
    assert pss_inventory.parse_rollup("Rss: 1 kB\nPss: 7 kB\n") == {
        "Pss": 7, "Pss_Anon": 0, "Pss_File": 0, "Pss_Shmem": 0
    }  # fmt: skip
    snap = {1: r, 2: pss_inventory.parse_rollup("Pss: 30 kB\nPss_Anon: 20 kB\n")}
    assert pss_inventory.total(snap) == 470386 and pss_inventory.total(snap, "Pss_Anon") == 419148


def test_workload_command_is_vs_trls(tmp_path: Path) -> None:
    model = tmp_path / "compute" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")  # built already: not built again
    (tmp_path / "compute" / "prompts.jsonl").write_text("")
    cmd = pss_inventory.workload_command("compute", "colocate1", 2, "miles", tmp_path)
    run_dir = Path(cmd[cmd.index("--run-dir") + 1])
    w = vs_trl.get_workload("compute")
    w = type(w)(**{**w.__dict__, "steps": 2, "warmup_steps": 1})
    assert cmd == vs_trl.miles_command(w, model, tmp_path / "compute" / "prompts.jsonl", run_dir, "colocate1")
    assert cmd[cmd.index("--num-rollout") + 1] == "2" and "--colocate" in cmd
