"""Start-up of the CPU quickstart, phase by phase and in CPU-seconds per process (issue 30).

    python scripts/bench/startup_cpu.py                                   # this checkout, 2 runs
    python scripts/bench/startup_cpu.py --code /tmp/base --code . --repeats 3   # A/B two checkouts, interleaved

Each run is `python -m miles.train` on the quickstart (2 trainers, colocated embedded engines; the tiny model and
echo data of `scripts/run-tiny-cpu.sh`, built into --artifacts if missing) with `--num-rollout 2`, with the
children importing `miles` from `--code`. While it starts, the process tree's CPU time (utime + stime from /proc)
is sampled every 0.1 s until the driver logs its `start-up:` line; each run prints that line (wall time per phase),
the CPU-seconds per kind of process (training ranks, engine servers, Ray actors by class, the driver, Ray's own
processes) and their total. On 2 cores start-up is bound by that total: compare it between checkouts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> dict[int, float]:
    """CPU-seconds of `root` and every process below it."""
    parent, cpu = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(pid)] = int(fields[1])
        cpu[int(pid)] = (int(fields[11]) + int(fields[12])) / TICKS
    found, todo = {root}, [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parent.items() if pp == pid and p not in found]
        found.update(kids)
        todo.extend(kids)
    return {p: cpu[p] for p in found if p in cpu}


def role(pid: int) -> str | None:
    """A process's kind, from its command line (Ray actors: their class); None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
    except OSError:
        return None
    if "ray::" in cmd:
        name = cmd.split("ray::", 1)[1].split()[0].split(".")[0]
        return None if name == "IDLE" else "trainer" if name == "TrainWorker" else name
    if any(a.endswith("agent_stub.py") for a in cmd.split()[:4]):  # the raylet's command line names it too
        return "DashboardAgent stub"
    for key, name in (("miles.engines.local", "engine server"), ("miles.train", "driver"),
                      ("log_monitor", "LogMonitor"), ("gcs_server", "gcs"), ("raylet", "raylet")):  # fmt: skip
        if key in cmd:
            return name
    return "other"


def run_once(code: Path, artifacts: Path) -> tuple[str, dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=str(code), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="1")  # fmt: skip
    cmd = [sys.executable, "-m", "miles.train", "--hf-checkpoint", str(artifacts / "model"),
           "--prompt-data", str(artifacts / "echo.jsonl"), "--input-key", "prompt", "--label-key", "label",
           "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "2",
           "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "2",
           "--global-batch-size", "128", "--micro-batch-size", "32", "--advantage-estimator", "grpo",
           "--optimizer", "adam", "--lr", "5e-3", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
           "--colocate", "--rollout-num-gpus-per-engine", "1", "--train-backend", "fsdp",
           "--run-dir", tempfile.mkdtemp(prefix="startup-cpu-"), "--seed", "1"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "start-up:" in line and not found:
                found.append(line.split("start-up:", 1)[1].strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    cpu: dict[int, float] = {}
    roles: dict[int, str] = {}
    while proc.poll() is None and not found:
        for pid, secs in tree_cpu(proc.pid).items():
            cpu[pid] = secs
            roles[pid] = role(pid) or roles.get(pid, "other")
        time.sleep(0.1)
    proc.wait()
    reader.join(timeout=5)
    if proc.returncode:
        raise SystemExit(f"run failed (exit {proc.returncode}) in {code}")
    by_role: dict[str, float] = {}
    for pid, secs in cpu.items():
        by_role[roles[pid]] = by_role.get(roles[pid], 0.0) + secs
    return (found[0] if found else "no start-up line"), by_role


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--code", action="append", type=Path, help="a checkout to run (repeatable; default: this one)"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--artifacts", type=Path, default=REPO / "artifacts" / "tiny")
    a = p.parse_args()
    if not (a.artifacts / "model" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "miles.tools.tiny_model", "--out", str(a.artifacts / "model"),
                        "--task", "echo", "--seed", "0", "--overwrite"], check=True, cwd=REPO)  # fmt: skip
    if not (a.artifacts / "echo.jsonl").exists():
        subprocess.run([sys.executable, "-m", "miles.tools.toy_data", "--task", "echo", "--out",
                        str(a.artifacts / "echo.jsonl"), "--n", "2000", "--seed", "0"], check=True, cwd=REPO)  # fmt: skip
    for r in range(a.repeats):
        for code in a.code or [REPO]:
            phases, by_role = run_once(code.resolve(), a.artifacts.resolve())
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_role.items(), key=lambda kv: -kv[1]))
            print(f"[{code} run {r + 1}] {phases}\n    CPU-s {sum(by_role.values()):.1f}: {cpu}", flush=True)


if __name__ == "__main__":
    main()
