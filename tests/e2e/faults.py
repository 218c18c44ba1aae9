"""Fault injection for the e2e fault-tolerance tests: generate functions that signal an engine mid-rollout.

Each is the stock single-turn generate function, except that the request of sample 5 of rollout 1 first sends a
signal to the server process of the first engine (found by its port in /proc), once per process: requests to that
engine are in flight at that moment, since the rollout sends up to --engine-max-running-requests per engine.
"""

from __future__ import annotations

import os
import signal
import time
from urllib.parse import urlparse

from miles.rollout.generate import generate_single_turn

_fired: set[str] = set()
FAULT_LOG_ENV = "MILES_TEST_FAULT_LOG"  # a file each injected fault is also written to


def engine_pid(url: str) -> int:
    """The pid of the embedded engine server listening on `url`'s port."""
    port = str(urlparse(url).port)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        # the launcher passes every value in its flag's token (--port=N); --port N as well
        ports = {a.removeprefix("--port=") for a in argv if a.startswith("--port=")}
        ports |= {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--port"}
        if "miles.engines.local" in argv and port in ports:
            return int(pid)
    raise LookupError(f"no engine server process listening on {url}")


async def _faulty(sig: signal.Signals, client, sample, sampling, ctx):
    if ctx.request_id_prefix == "rollout1" and sample.index == 5 and sig.name not in _fired:
        _fired.add(sig.name)
        pid = engine_pid(client.engine_urls[0])
        line = f"fault injection: {sig.name} to engine {client.engine_urls[0]} (pid {pid})"
        print(line, flush=True)
        if os.environ.get(FAULT_LOG_ENV):  # the driver's tests read it (Ray forwards prints only eventually)
            with open(os.environ[FAULT_LOG_ENV], "a") as f:
                f.write(line + "\n")
        os.kill(pid, sig)
    return await generate_single_turn(client, sample, sampling, ctx)


async def sigkill_engine(client, sample, sampling, ctx):
    return await _faulty(signal.SIGKILL, client, sample, sampling, ctx)


async def sigstop_engine(client, sample, sampling, ctx):
    return await _faulty(signal.SIGSTOP, client, sample, sampling, ctx)


class StuckTrainWorker:
    """A training-worker stand-in for the Ray fan-out tests: rank 1 hangs in the save of rollout 3 and dies in
    the save of rollout 4 (here, not in the test module, so that Ray workers can import it)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def save(self, rollout_id: int, extra_state: dict) -> None:
        if self.rank == 1 and rollout_id == 3:
            time.sleep(600)
        if self.rank == 1 and rollout_id == 4:
            os._exit(1)


def stuck_in_train_step() -> None:
    time.sleep(600)


class HangingTrainWorker:
    """A training-worker stand-in for the hang-dump test: it installs the stack dumps as a training rank does
    (into `stacks_dir`), and rank 1's train call hangs in `stuck_in_train_step`."""

    def __init__(self, rank: int, stacks_dir: str) -> None:
        from miles.utils import hang_dump

        hang_dump.install(stacks_dir, f"trainer-actor-rank{rank}")
        self.rank = rank

    def train(self, rollout_id: int, samples: list) -> dict:
        if self.rank == 1:
            stuck_in_train_step()
        return {}
