"""Peak memory of a command's whole process tree, process by process: runs the command (default: the CPU
quickstart, a few rollouts), samples PSS (/proc/PID/smaps_rollup) of every process in the tree each second, and
prints the peak total with what each process held at that moment, and the run's start-up line.

    python3 scripts/bench/pss_inventory.py [--rollouts 3] [-- CMD ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import _read, parse_pss_kib, process_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _label(pid: int) -> str:
    args = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
    comm = (_read(f"/proc/{pid}/comm") or "").strip()
    # the script and its first arguments, site-packages prefixes cut: default_worker.py, dashboard/agent.py, ...
    short = [re.sub(r".*site-packages/", "", x) for x in args[1:] if x]
    return f"{comm:<16} {' '.join(short)[:110]}"


def snapshot(root: int) -> dict[int, int]:
    """pid -> PSS KiB of every live process in `root`'s tree."""
    out = {}
    for pid in process_tree(root):
        rollup = _read(f"/proc/{pid}/smaps_rollup")
        if rollup:
            out[pid] = parse_pss_kib(rollup)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("cmd", nargs="*")
    a = ap.parse_args()
    env = dict(os.environ, MILES_SKIP_INSTALL="1", NUM_ROLLOUT=str(a.rollouts), PYTHONPATH=str(ROOT))
    env.setdefault("MILES_TINY_DIR", "/work/main/artifacts/tiny")
    env.setdefault("RUN_DIR", f"/tmp/pss-inv-{os.getpid()}")
    cmd = a.cmd or ["bash", "scripts/run-tiny-cpu.sh"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    peak: dict[int, int] = {}
    labels: dict[int, str] = {}
    most = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak, most
        while not stop.is_set():
            snap = snapshot(proc.pid)
            for pid in snap:
                labels.setdefault(pid, _label(pid))
            most = max(most, len(snap))
            if sum(snap.values()) > sum(peak.values()):
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
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    print(f"rc {rc}, wall {time.time() - t0:.1f}s, most processes {most}")
    print(startup)
    for pid, kib in sorted(peak.items(), key=lambda kv: -kv[1]):
        print(f"{kib / 1024:8.1f} MiB  {pid:>7}  {labels.get(pid, '?')}")
    print(f"peak PSS {sum(peak.values()) / 1024:.0f} MiB over {len(peak)} processes")


if __name__ == "__main__":
    main()
