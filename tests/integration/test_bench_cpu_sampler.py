"""scripts/bench/benchlib.py's CPU sampler on a real process tree (the async bench's per-run CPU measure, issue 25):
it runs a child that spins in a grandchild."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

benchlib = importlib.import_module("benchlib")


def test_run_timed_samples_the_cpu_of_the_whole_tree(tmp_path: Path) -> None:
    """A child that spins ~0.4 s in a grandchild: the sampler sees both processes, their command lines, and the
    grandchild's CPU time."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}, 'spinner'])"
    run = benchlib.run_timed([sys.executable, "-c", code], {}, tmp_path, timeout_s=30, cpu_interval=0.05)
    assert run.returncode == 0 and run.cpu is not None and len(run.cpu.history) >= 3
    used = benchlib.cpu_delta(run.cpu.history, 0.0, 1e9)
    spinner = [pid for pid, cmd in run.cpu.cmdlines.items() if cmd.endswith("spinner")]
    assert len(used) >= 2 and len(spinner) == 1 and used[spinner[0]] >= 0.2
    machine = run.cpu.machine  # the whole machine's busy CPU-s: at least the spinner's
    assert machine[-1][1] - machine[0][1] >= 0.2
    own = run.cpu.own  # this process's: it did not spin
    assert len(own) == len(run.cpu.history) and own[-1][1] - own[0][1] < 0.2
    assert benchlib.run_timed([sys.executable, "-c", "pass"], {}, tmp_path, timeout_s=30).cpu is None
