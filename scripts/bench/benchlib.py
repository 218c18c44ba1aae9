"""Shared pieces of the benchmarks: process-tree memory, a subprocess whose output lines are timestamped, and the
statistics the reports print (medians and spreads, steady-state step times, ratios). No torch import."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ------------------------------------------------------------------------------------------------ memory
def parse_ppid(stat: str) -> int:
    """Parent pid from the text of /proc/PID/stat (the command name may hold spaces and parentheses)."""
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and every process whose parent chain reaches it, from a pid -> ppid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:  # the process ended meanwhile
        return None


def process_tree(root: int) -> list[int]:
    """Live pids of `root`'s process tree (Linux /proc)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read(f"/proc/{name}/stat")
            if stat:
                parents[int(name)] = parse_ppid(stat)
    return descendants(root, parents) if root in parents else []


def parse_pss_kib(smaps_rollup: str) -> int:
    """The `Pss:` line of /proc/PID/smaps_rollup, in KiB (0 if absent)."""
    for line in smaps_rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def tree_memory(root: int) -> tuple[int, int, int]:
    """(sum of RSS bytes, sum of PSS bytes, process count) over `root`'s process tree.

    RSS counts shared pages once per process that maps them (what "sum RSS" means); PSS splits them among the
    sharers, so its sum is the memory the tree really holds.
    """
    rss = pss = n = 0
    for pid in process_tree(root):
        statm = _read(f"/proc/{pid}/statm")
        if not statm:
            continue
        n += 1
        rss += int(statm.split()[1]) * PAGE
        rollup = _read(f"/proc/{pid}/smaps_rollup")
        pss += parse_pss_kib(rollup) * 1024 if rollup else 0
    return rss, pss, n


class _Sampler:
    """A daemon thread that calls `sample()` every `interval` seconds while the `with` block runs."""

    def __init__(self, name: str, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        raise NotImplementedError


class MemorySampler(_Sampler):
    """Samples `tree_memory(pid)` every `interval` seconds in a thread; keeps the peaks."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(f"mem-{pid}", interval)
        self.pid = pid
        self.peak_rss = self.peak_pss = self.peak_procs = 0

    def sample(self) -> None:
        rss, pss, n = tree_memory(self.pid)
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.peak_procs = max(self.peak_procs, n)


# ------------------------------------------------------------------------------------------------ CPU time
def parse_cpu_s(stat: str) -> float:
    """CPU-seconds (utime + stime, all threads) from the text of /proc/PID/stat."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def tree_cpu(root: int) -> dict[int, float]:
    """CPU-seconds so far of each live process of `root`'s tree (Linux /proc; waited-for children's time is not
    in their parent's utime/stime, so the sum over the tree counts nothing twice)."""
    parents, cpu = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read(f"/proc/{name}/stat")
            if stat:
                parents[int(name)], cpu[int(name)] = parse_ppid(stat), parse_cpu_s(stat)
    return {pid: cpu[pid] for pid in descendants(root, parents)} if root in parents else {}


def parse_busy_cpu_s(proc_stat: str) -> float:
    """CPU-seconds the whole machine has been busy (user, nice, system, irq, softirq, steal; guest time is in
    user already), from the `cpu` line of /proc/stat."""
    fields = [int(x) for x in proc_stat.split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / TICKS


def cpu_delta(
    history: Sequence[tuple[float, dict[int, float]]], start: float, end: float
) -> dict[int, float]:
    """CPU-seconds each pid used in [start, end], from (time, {pid: cumulative CPU-s}) samples in time order.
    A pid's value is linearly interpolated between its samples; before its first sample it is 0 at the sample
    before (it did not exist yet; held flat when it was there at the first sample), after its last it is held
    flat (it ended)."""
    series: dict[int, list[tuple[float, float]]] = {}
    prev_t: float | None = None
    for t, cpu in history:
        for pid, secs in cpu.items():
            if pid not in series and prev_t is not None:
                series[pid] = [(prev_t, 0.0)]
            series.setdefault(pid, []).append((t, secs))
        prev_t = t

    def at(points: list[tuple[float, float]], t: float) -> float:
        if t <= points[0][0]:
            return points[0][1]
        for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
            if t <= t1:
                return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
        return points[-1][1]

    return {pid: at(pts, end) - at(pts, start) for pid, pts in series.items()}


class CpuSampler(_Sampler):
    """Samples `tree_cpu(pid)` every `interval` seconds in a thread: `history` holds (seconds after `t0`,
    {pid: CPU-s}), `machine` (seconds after `t0`, the whole machine's busy CPU-s: the tree's and everyone
    else's), `own` (seconds after `t0`, this process's CPU-s: the sampler, and whatever else the caller runs)
    and `cmdlines` each pid's last non-empty command line (a Ray worker renames itself once it hosts an
    actor)."""

    def __init__(self, pid: int, t0: float, interval: float = 0.5) -> None:
        super().__init__(f"cpu-{pid}", interval)
        self.pid, self.t0 = pid, t0
        self.history: list[tuple[float, dict[int, float]]] = []
        self.cmdlines: dict[int, str] = {}
        self.machine: list[tuple[float, float]] = []
        self.own: list[tuple[float, float]] = []

    def sample(self) -> None:
        cpu, busy = tree_cpu(self.pid), _read("/proc/stat")
        self.history.append((time.time() - self.t0, cpu))
        if busy:
            self.machine.append((time.time() - self.t0, parse_busy_cpu_s(busy)))
        self.own.append((time.time() - self.t0, time.process_time()))
        for pid in cpu:  # read each time: a few dozen small reads
            cmd = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
            self.cmdlines[pid] = cmd or self.cmdlines.get(pid, "")


# ------------------------------------------------------------------------------------------------ processes
@dataclass
class TimedRun:
    """A finished subprocess: exit code, its output lines with the wall time each arrived, memory peaks."""

    returncode: int
    launched_at: float  # time.time() just before the process started
    lines: list[tuple[float, str]] = field(default_factory=list)
    peak_rss: int = 0
    peak_pss: int = 0
    peak_procs: int = 0
    # with `cpu_interval`: the process tree's CPU time per process (times after launched_at)
    cpu: CpuSampler | None = None

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def run_timed(
    cmd: Sequence[str],
    env: dict[str, str],
    cwd: str | os.PathLike[str],
    timeout_s: float,
    log_path: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    cpu_interval: float | None = None,
) -> TimedRun:
    """Run `cmd` in its own session, timestamp every output line (stdout and stderr merged), sample the memory
    of its process tree (and, with `cpu_interval`, its CPU time per process: `TimedRun.cpu`); kill the whole
    session past `timeout_s` (then returncode is -9)."""
    launched = time.time()
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    run = TimedRun(returncode=0, launched_at=launched)
    killer = threading.Timer(timeout_s, lambda: _kill_session(proc))
    killer.start()
    log = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115 - closed below
    if cpu_interval:
        run.cpu = CpuSampler(proc.pid, launched, cpu_interval)
    try:
        with MemorySampler(proc.pid) as mem, run.cpu or contextlib.nullcontext():
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.time()
                line = line.rstrip("\n")
                run.lines.append((now, line))
                if log:
                    log.write(f"{now - launched:9.3f} {line}\n")
                if on_line:
                    on_line(line)
            run.returncode = proc.wait()
        run.peak_rss, run.peak_pss, run.peak_procs = mem.peak_rss, mem.peak_pss, mem.peak_procs
    finally:
        killer.cancel()
        if proc.poll() is None:
            _kill_session(proc)
        _kill_session(proc)  # leftovers of the session (Ray's daemons) once the leader is gone
        if log:
            log.close()
    return run


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class Spread:
    """Median and range of a set of measurements."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vals = [v for v in values if v == v]  # drop NaN
        if not vals:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(statistics.median(vals), min(vals), max(vals), len(vals))

    def fmt(self, digits: int = 3) -> str:
        if self.n == 0:
            return "n/a"
        if self.n == 1:
            return f"{self.median:.{digits}g}"
        return f"{self.median:.{digits}g} [{self.lo:.{digits}g}-{self.hi:.{digits}g}]"


def step_intervals(step_end_times: Sequence[float], warmup: int) -> list[float]:
    """Seconds of each steady step: the gaps between consecutive step ends, from the end of step `warmup - 1`
    (the first `warmup` steps are left out). Needs `warmup >= 1` so every kept step has a known start."""
    if warmup < 1:
        raise ValueError(f"warmup={warmup}: must be >= 1 (a step's start is the previous step's end)")
    t = list(step_end_times)
    return [t[i] - t[i - 1] for i in range(warmup, len(t))]


def write_json_atomic(obj: object, path: Path) -> None:
    """Write `obj` as indented JSON via a temp file + rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def mib(n: float) -> float:
    return n / 2**20
