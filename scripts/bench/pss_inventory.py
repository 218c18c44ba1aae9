"""Peak memory of a command's whole process tree, process by process: runs the command (default: the CPU
quickstart, a few rollouts), samples PSS (/proc/PID/smaps_rollup) of every process in the tree each second, and
prints the peak total with what each process held at that moment (PSS split into anonymous memory, i.e. heap,
tensors and malloc arenas, and file-backed pages, i.e. shared libraries and mapped files), and the run's start-up
line. `--workload` runs the miles (or, `--system trl`, TRL) command line of a `vs_trl.py` workload instead.

    python3 scripts/bench/pss_inventory.py [--rollouts 3] [-- CMD ...]
    python3 scripts/bench/pss_inventory.py --workload compute [--placement colocate2] [--steps 2] [--system trl]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import _read, process_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _label(pid: int) -> str:
    args = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
    comm = (_read(f"/proc/{pid}/comm") or "").strip()
    # the script and its first arguments, site-packages prefixes cut: default_worker.py, dashboard/agent.py, ...
    short = [re.sub(r".*site-packages/", "", x) for x in args[1:] if x]
    return f"{comm:<16} {' '.join(short)[:110]}"


ROLLUP_KEYS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def parse_rollup(text: str) -> dict[str, int]:
    """The `ROLLUP_KEYS` lines of /proc/PID/smaps_rollup, in KiB (0 for a key the kernel does not report)."""
    out = dict.fromkeys(ROLLUP_KEYS, 0)
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in out:
            out[key] = int(rest.split()[0])
    return out


def snapshot(root: int) -> dict[int, dict[str, int]]:
    """pid -> `parse_rollup` of every live process in `root`'s tree."""
    out = {}
    for pid in process_tree(root):
        rollup = _read(f"/proc/{pid}/smaps_rollup")
        if rollup:
            out[pid] = parse_rollup(rollup)
    return out


def total(snap: dict[int, dict[str, int]], key: str = "Pss") -> int:
    return sum(v[key] for v in snap.values())


def workload_command(
    name: str, placement: str | None, steps: int | None, system: str, work: Path
) -> list[str]:
    """The command line `vs_trl.py` runs for workload `name` (model and prompts built under `work` once)."""
    import dataclasses

    import vs_trl
    from bench_workloads import build_model, get_workload, make_rows, write_rows

    w = get_workload(name)
    if steps is not None:
        w = dataclasses.replace(w, steps=steps, warmup_steps=min(w.warmup_steps, steps - 1))
    model, data = work / name / "model", work / name / "prompts.jsonl"
    if not (model / "config.json").exists():
        build_model(w, model)
    if not data.exists():
        write_rows(make_rows(w, 4000, seed=0), data)
    run_dir = work / name / f"{system}-{os.getpid()}"
    if system == "trl":
        venv = Path(os.environ.get("MILES_TRL_VENV", vs_trl.REPO / ".venv-trl"))
        spec = json.dumps(dataclasses.asdict(w))
        return [str(vs_trl.trl_python(venv)), str(vs_trl.HERE / "trl_child.py"), "--model", str(model),
                "--data", str(data), "--spec", spec, "--out", str(run_dir / "trainer")]  # fmt: skip
    return vs_trl.miles_command(w, model, data, run_dir, placement or vs_trl.DEFAULT_PLACEMENT[name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--workload", default=None, help="run this vs_trl.py workload's command line")
    ap.add_argument("--placement", default=None, help="--workload: miles placement (vs_trl.PLACEMENTS)")
    ap.add_argument(
        "--steps", type=int, default=None, help="--workload: optimizer steps (default: the workload's)"
    )
    ap.add_argument(
        "--system", default="miles", choices=("miles", "trl"), help="--workload: which system runs"
    )
    ap.add_argument("--work-dir", default="/tmp/pss-inv-work", help="--workload: models and prompts, reused")
    ap.add_argument(
        "--timeline", default=None, help="write every sample (seconds, pid -> PSS KiB) as JSON lines"
    )
    ap.add_argument("cmd", nargs="*")
    a = ap.parse_args()
    env = dict(os.environ, MILES_SKIP_INSTALL="1", NUM_ROLLOUT=str(a.rollouts), PYTHONPATH=str(ROOT))
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.setdefault("MILES_TINY_DIR", "/work/main/artifacts/tiny")
    env.setdefault("RUN_DIR", f"/tmp/pss-inv-{os.getpid()}")
    if a.workload:
        cmd = workload_command(a.workload, a.placement, a.steps, a.system, Path(a.work_dir))
    else:
        cmd = a.cmd or ["bash", "scripts/run-tiny-cpu.sh"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    peak: dict[int, dict[str, int]] = {}
    labels: dict[int, str] = {}
    most = 0
    stop = threading.Event()

    timeline = open(a.timeline, "w") if a.timeline else None  # noqa: SIM115 (closed after the run)

    def sample() -> None:
        nonlocal peak, most
        while not stop.is_set():
            snap = snapshot(proc.pid)
            if timeline:
                pss = {pid: r["Pss"] for pid, r in snap.items()}
                timeline.write(json.dumps({"t": round(time.time() - t0, 1), "pss_kib": pss}) + "\n")
            for pid in snap:
                labels.setdefault(pid, _label(pid))
            most = max(most, len(snap))
            if total(snap) > total(peak):
                peak = snap
            stop.wait(a.interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    startup = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if "start-up:" in line:
            startup = line.strip()
        if os.environ.get("PSS_VERBOSE"):
            print(line, end="")
    rc = proc.wait()
    stop.set()
    th.join()
    if timeline:
        timeline.close()
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    if timeline:
        print("timeline labels: " + json.dumps({p: labels[p] for p in labels}))
    print(f"rc {rc}, wall {time.time() - t0:.1f}s, most processes {most}")
    print(startup)
    print("     PSS      anon      file  (MiB)     pid  process")
    for pid, r in sorted(peak.items(), key=lambda kv: -kv[1]["Pss"]):
        cols = "".join(f"{r[k] / 1024:8.1f}  " for k in ("Pss", "Pss_Anon", "Pss_File"))
        print(f"{cols}     {pid:>7}  {labels.get(pid, '?')}")
    anon, file = total(peak, "Pss_Anon") / 1024, total(peak, "Pss_File") / 1024
    print(
        f"peak PSS {total(peak) / 1024:.0f} MiB over {len(peak)} processes (anon {anon:.0f}, file {file:.0f})"
    )


if __name__ == "__main__":
    main()
