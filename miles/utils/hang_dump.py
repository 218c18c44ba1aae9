"""Hang forensics: the Python stacks (all threads) of every miles process, dumped when a deadline expires or when
the driver gets SIGUSR1, into `<run-dir>/logs/hang-<time>/`, one file per process.

How: each miles process calls `install(stacks_dir, role)` at start (the driver, each training rank, the rollout
manager, the engine fleet, each engine actor, each embedded engine server). It opens its own file
`<run-dir>/logs/stacks/<role>.<host>.<pid>.txt` (first line: a JSON header naming role, host, pid and the
process's start time) and has `faulthandler` write every thread's stack there on SIGUSR1 (the driver: on
SIGUSR2; its SIGUSR1 runs `dump_all`, the on-demand dump of every process). `faulthandler` and
not a Python-level signal handler, because its handler is C: it writes even when the thread that holds the GIL
is stuck in C (a torch op, a collective, a C extension), and in a Ray actor idling in Ray's C++ task loop,
where a Python handler would never run. Its file must be open before the signal, hence one file per process
opened at start, from which a dump copies what the signal appended into the hang folder.

`dump_all(reason, stalled)` (any installed process may call it: the one whose deadline expired does) makes the
hang folder, writes its own stacks there, sends SIGUSR1 to every other installed process of this host (found
by their files, checked to be the same process by pid and start time, so a reused pid is never signalled),
waits for their dumps (a few seconds at most), copies each into the folder as `<role>-pid<pid>.txt`, and
writes `index.txt` (the reason, the stalled component, and each process: dumped, no dump in time (a stopped
process writes it once continued), or on another host). Best effort: it never raises, and a dump in the last
`REUSE_S` seconds is named again instead of taking another (a burst of expiring requests takes one dump).

`expired(message, stalled)` is the one place deadline errors get their note: `message` plus the folder (unchanged
when this process never called `install`); the callers are the deadline errors: `ray_get`/`phase_timeout`
(rollout, train, refit, save, eval waits of the driver), `EngineTimeout` (engine calls: refit, memory control),
and the rollout's request deadline (`miles.rollout.generate_client`).

Processes on other hosts (multi-node) cannot be signalled from here: `index.txt` lists them with the command to
run on their host (`kill -USR1 <pid>`), which appends their stacks to their own file under `logs/stacks/` on
that host. `ray stack` (py-spy) is not needed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

logger = logging.getLogger(__name__)

STACKS_DIR_ENV = "MILES_STACKS_DIR"  # children (embedded engine servers) install into their parent's folder
REUSE_S = 60.0  # a dump this recent is named again instead of taking another
WAIT_S = 5.0  # how long a dump waits for the other processes to write their stacks
SIGNAL = signal.SIGUSR1  # what a process dumps its stacks on; the driver: every process's (see `install`)
DRIVER_OWN = signal.SIGUSR2  # what the driver dumps only its own stacks on (a dump another process takes)


@dataclass
class _Installed:
    stacks_dir: str
    role: str
    file: IO[str]  # this process's stacks file (faulthandler writes to its fd)


_installed: _Installed | None = None
_lock = threading.Lock()
_last: tuple[float, str] | None = None  # (time.monotonic() of the last dump, its folder)


def stacks_dir_of(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "logs", "stacks")


def _host() -> str:
    return socket.gethostname()


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _safe(role: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", role)


def install(stacks_dir: str, role: str, driver: bool = False) -> str | None:
    """This process dumps its stacks into `stacks_dir` (see the module docstring) as `role`; returns its stacks
    file. The driver (`driver=True`) instead answers SIGUSR1 by `dump_all` (every process, into a hang folder)
    and dumps only its own stacks on SIGUSR2 (what a dump taken by another process sends it); it also removes the files of processes that are gone (an earlier run in the same run directory). Children
    started after this inherit `stacks_dir` (`MILES_STACKS_DIR`). Best effort: a failure is logged."""
    global _installed
    try:
        os.makedirs(stacks_dir, exist_ok=True)
        os.environ[STACKS_DIR_ENV] = stacks_dir
        if driver:
            _remove_stale(stacks_dir)
        pid = os.getpid()
        path = os.path.join(stacks_dir, f"{_safe(role)}.{_safe(_host())}.{pid}.txt")
        f = open(path, "a", buffering=1)  # noqa: SIM115 - held for the process's life: faulthandler writes to it
        own = DRIVER_OWN if driver else SIGNAL
        header = {"role": role, "host": _host(), "pid": pid, "start": _start_time(pid), "signal": int(own)}
        f.write(json.dumps(header) + "\n")
        f.flush()
        faulthandler.register(own, file=f, all_threads=True, chain=False)
        if driver:
            signal.signal(SIGNAL, _on_driver_signal)
        if _installed is not None:
            _installed.file.close()
        _installed = _Installed(stacks_dir, role, f)
        return path
    except Exception as e:  # noqa: BLE001 - forensics must never stop a process from starting
        logger.warning("hang dumps: could not install for %s in %s: %s", role, stacks_dir, e)
        return None


def install_from_env(role: str) -> str | None:
    """`install` into the parent's folder (`MILES_STACKS_DIR`), if the parent installed one."""
    stacks_dir = os.environ.get(STACKS_DIR_ENV)
    return install(stacks_dir, role) if stacks_dir else None


def uninstall() -> None:
    """Forget the installation (tests): SIGUSR1 back to its default, the file closed."""
    global _installed, _last
    if _installed is None:
        return
    for sig in (SIGNAL, DRIVER_OWN):
        with contextlib.suppress(Exception):
            faulthandler.unregister(sig)
            signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        _installed.file.close()
    os.environ.pop(STACKS_DIR_ENV, None)
    _installed, _last = None, None


def _on_driver_signal(signum: int, frame: object) -> None:
    """SIGUSR1 to the driver: dump every process, from a thread (the main loop goes on)."""

    def run() -> None:
        folder = dump_all("SIGUSR1 to the driver", None, reuse_s=0.0)
        if folder:
            print(f"miles: stacks of every miles process written to {folder}", file=sys.stderr, flush=True)

    threading.Thread(target=run, name="miles-hang-dump", daemon=True).start()


@dataclass
class _Process:
    path: str
    role: str
    host: str
    pid: int
    start: str | None
    signal: int  # what to send it for its stacks


def _read_header(path: str) -> _Process | None:
    try:
        with open(path) as f:
            h = json.loads(f.readline())
        return _Process(path, str(h["role"]), str(h["host"]), int(h["pid"]), h.get("start"), int(h["signal"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(p: _Process) -> bool:
    """The process that wrote `p` still runs (same pid and start time), on this host."""
    if p.host != _host():
        return False
    start = _start_time(p.pid)
    if start is None and os.path.exists("/proc/self/stat"):
        return False  # gone
    return start == p.start


def _processes(stacks_dir: str) -> list[_Process]:
    found = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(stacks_dir)):
            p = _read_header(os.path.join(stacks_dir, name)) if name.endswith(".txt") else None
            if p is not None:
                found.append(p)
    return found


def _remove_stale(stacks_dir: str) -> None:
    for p in _processes(stacks_dir):
        if p.host == _host() and not _alive(p):
            with contextlib.suppress(OSError):
                os.remove(p.path)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _new_folder(logs_dir: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = os.path.join(logs_dir, f"hang-{stamp}")
    n = 1
    while True:
        try:
            os.makedirs(folder)
            return folder
        except FileExistsError:
            n += 1
            folder = os.path.join(logs_dir, f"hang-{stamp}-{n}")


def dump_all(
    reason: str, stalled: str | None, wait_s: float = WAIT_S, reuse_s: float = REUSE_S
) -> str | None:
    """Dump the stacks of every installed miles process into a new `<run-dir>/logs/hang-<time>/`; returns the
    folder (None when this process never called `install`, or the dump failed). Never raises."""
    global _last
    inst = _installed
    if inst is None:
        return None
    try:
        with _lock:
            if _last is not None and time.monotonic() - _last[0] < reuse_s:
                return _last[1]
            folder = _dump(inst, reason, stalled, wait_s)
            _last = (time.monotonic(), folder)
            return folder
    except Exception as e:  # noqa: BLE001 - a dump must never raise into the failure path it documents
        logger.warning("hang dump failed: %s", e)
        return None


def _dump(inst: _Installed, reason: str, stalled: str | None, wait_s: float) -> str:
    folder = _new_folder(os.path.dirname(inst.stacks_dir))
    me = os.getpid()
    lines = [
        f"reason: {reason}",
        f"stalled: {stalled or 'not known'}",
        f"dumped by: {inst.role} (pid {me})",
        "",
    ]
    with open(os.path.join(folder, f"{_safe(inst.role)}-pid{me}.txt"), "w") as f:
        f.write(f"# {inst.role}, pid {me}, host {_host()} (the process that took this dump)\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    lines.append(f"{inst.role} pid {me}: {_safe(inst.role)}-pid{me}.txt")
    asked: dict[str, tuple[_Process, int]] = {}  # path -> (process, size before the signal)
    for p in _processes(inst.stacks_dir):
        if p.pid == me and p.host == _host():
            continue
        if p.host != _host():
            lines.append(f"{p.role} pid {p.pid}: on host {p.host}; run `kill -{signal.Signals(p.signal).name[3:]} "
                         f"{p.pid}` there (its stacks go to {p.path} on that host)")  # fmt: skip
            continue
        if not _alive(p):
            continue
        before = _size(p.path)
        try:
            os.kill(p.pid, p.signal)
        except OSError as e:
            lines.append(f"{p.role} pid {p.pid}: could not signal: {e}")
            continue
        asked[p.path] = (p, before)
    waiting = dict(asked)
    last_sizes: dict[str, int] = {}
    end = time.monotonic() + wait_s
    while waiting and time.monotonic() < end:
        time.sleep(0.05)
        for path, (_, before) in list(waiting.items()):
            size = _size(path)
            if size > before and last_sizes.get(path) == size:  # grew, and stopped growing
                del waiting[path]
            last_sizes[path] = size
    for path, (p, before) in asked.items():
        name = f"{_safe(p.role)}-pid{p.pid}.txt"
        try:
            with open(path, "rb") as src:
                src.seek(max(before, 0))
                text = src.read()
        except OSError:
            text = b""
        note = "" if path not in waiting else " (incomplete: still writing, or no answer in time)"
        if not text:
            lines.append(f"{p.role} pid {p.pid}: no dump within {wait_s:g}s (a stopped (SIGSTOP) process writes "
                         f"it once continued, to {path})")  # fmt: skip
            continue
        with open(os.path.join(folder, name), "wb") as dst:
            dst.write(f"# {p.role}, pid {p.pid}, host {p.host}\n".encode())
            dst.write(text)
        lines.append(f"{p.role} pid {p.pid}: {name}{note}")
    with open(os.path.join(folder, "index.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    logger.warning("%s: stacks of every miles process written to %s", reason, folder)
    return folder


def expired(message: str, stalled: str) -> str:
    """A deadline error's message: `message` (which names the stalled component), then the hang folder that
    `dump_all` wrote, whose index.txt names `stalled` too (`message` unchanged when this process has no dumps
    installed, or the dump failed)."""
    folder = dump_all(message, stalled)
    if folder is None:
        return message
    return f"{message} [Python stacks of every miles process: {folder}]"
