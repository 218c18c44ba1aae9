"""Start-up of the CPU quickstart, phase by phase and in CPU-seconds per process (issue 30).

    python scripts/bench/startup_cpu.py                                   # this checkout, 2 runs
    python scripts/bench/startup_cpu.py --code /tmp/base --code . --repeats 3   # A/B two checkouts, interleaved

Each run is `python -m miles.train` on the quickstart (2 trainers, colocated embedded engines; the tiny model and
echo data of `scripts/run-tiny-cpu.sh`, built into --artifacts if missing) with `--num-rollout 2`, with the
children importing `miles` from `--code`. While it starts, the process tree's CPU time (utime + stime from /proc)
is sampled every 0.1 s until the driver logs its `start-up:` line; each run prints that line (wall time per phase),
the CPU-seconds per kind of process (training ranks, engine servers, Ray actors by class, the driver, Ray's own
processes) and their total. On 2 cores start-up is bound by that total: compare it between checkouts.

    python scripts/bench/startup_cpu.py --rank-parts --code /tmp/base --code .   # one training rank, part by part
    python scripts/bench/startup_cpu.py --workload compute                # vs_trl.py's compute workload instead

`--workload compute` (or varlen) runs that `vs_trl.py` workload's miles command instead of the quickstart (its
model and prompts built into --artifacts/<workload> if missing; 2 rollouts, the default placement, logging at INFO
for the `start-up:` line).

`--rank-parts` runs, per repeat and checkout, two training ranks without Ray (two processes with `ray` imported
before the clock starts, as a Ray worker has it, joined by gloo on loopback) through what a rank does from its
process start to its first step: import torch, import the backend (transformers' model code, FSDP), `init` (model,
FSDP, optimizer), the engine it hosts (`launch_engine`) and the start-up refit; it prints each part's CPU-seconds
(time.process_time, all of the rank's threads), averaged over the two ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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


def quickstart_flags(artifacts: Path) -> list[str]:
    return ["--hf-checkpoint", str(artifacts / "model"),
           "--prompt-data", str(artifacts / "echo.jsonl"), "--input-key", "prompt", "--label-key", "label",
           "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "2",
           "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "2",
           "--global-batch-size", "128", "--micro-batch-size", "32", "--advantage-estimator", "grpo",
           "--optimizer", "adam", "--lr", "5e-3", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
           "--colocate", "--rollout-num-gpus-per-engine", "1", "--train-backend", "fsdp",
           "--run-dir", tempfile.mkdtemp(prefix="startup-cpu-"), "--seed", "1"]  # fmt: skip


def workload_flags(name: str, artifacts: Path) -> list[str]:
    """`vs_trl.py`'s miles flags for workload `name` (its model and prompts under `artifacts`, built if missing),
    with 2 rollouts and INFO logging; the quickstart's own flags for "quickstart"."""
    if name == "quickstart":
        return quickstart_flags(artifacts)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vs_trl
    from bench_workloads import build_model, get_workload, make_rows, write_rows

    w = get_workload(name)
    model, data = artifacts / name / "model", artifacts / name / "prompts.jsonl"
    if not (model / "config.json").exists():
        build_model(w, model)
    if not data.exists():
        write_rows(make_rows(w, 4000, seed=0), data)
    run_dir = Path(tempfile.mkdtemp(prefix="startup-cpu-"))
    cmd = vs_trl.miles_command(w, model, data, run_dir, vs_trl.DEFAULT_PLACEMENT[name])
    flags = cmd[3:]  # after `python -m miles.train`
    flags[flags.index("--num-rollout") + 1] = "2"
    flags[flags.index("--log-level") + 1] = "INFO"
    return flags


def child_env(code: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(code), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="1")  # fmt: skip


def run_once(code: Path, flags: list[str]) -> tuple[str, dict[str, float]]:
    env = child_env(code)
    cmd = [sys.executable, "-m", "miles.train", *flags]
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


def rank_child(rank: int, port: int, flags: list[str]) -> None:
    """One training rank's start-up, part by part (see the module doc); prints its CPU-seconds per part as JSON."""
    import ray  # noqa: F401  - a Ray worker has it imported before its actor starts

    parts: dict[str, float] = {}
    last = time.process_time()

    def mark(name: str) -> None:
        nonlocal last
        now = time.process_time()
        parts[name], last = now - last, now

    import torch  # noqa: F401

    mark("import torch")
    from miles.backends import get_policy_class
    from miles.config import parse_config
    from miles.ray.colocate import MEMORY_TAGS
    from miles.ray.train_group import TrainWorker

    get_policy_class("fsdp")
    mark("import backend")
    cfg = parse_config(flags)
    worker = TrainWorker(cfg, rank, 2, {"OMP_NUM_THREADS": "1"})
    worker.init("127.0.0.1", port, "actor", False)
    mark("init")
    from miles.engines.sglang_engine import engine_launch_kwargs

    local = {
        "max-running-requests": cfg.engine.engine_max_running_requests,
        "request-timeout": 600.0,
        "num-threads": 1,
    }  # as EngineFleet._engine_kwargs on CPU
    if engine_starts_released():
        local["start-released"] = True  # as EngineFleet.host_engines
    launch = engine_launch_kwargs("local", rank, cfg.rollout.rollout_seed, True, {}, local)
    url = worker.launch_engine({"model_path": cfg.model.hf_checkpoint, "local_args": launch["local_args"]})
    mark("engine")
    import torch.distributed as dist

    from miles.utils.engine_control_http import EngineMemoryControl

    urls: list[str | None] = [None, None]
    dist.all_gather_object(urls, url)
    control = EngineMemoryControl([url], None, 60.0)  # as the driver: release all, resume all, refit
    control.release_memory(list(MEMORY_TAGS))
    control.resume_memory(list(MEMORY_TAGS))
    dist.barrier()
    worker.update_weights([str(u) for u in urls], "0")
    mark("first refit")
    print("RANK-PARTS " + json.dumps(parts), flush=True)
    worker.shutdown_engine()


def engine_starts_released() -> bool:
    """Whether this checkout's engine has `--start-released` (its fleet then starts the hosted engines so)."""
    from miles.engines.local.engine import LocalEngineConfig

    return "start_released" in LocalEngineConfig.__dataclass_fields__


def rank_parts(code: Path, artifacts: Path, workload: str) -> dict[str, float]:
    """Two ranks of `code` through `rank_child`: CPU-seconds per part, averaged over the ranks."""
    port = free_port()
    env = dict(child_env(code), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--rank-child",
                str(rank),
                str(port),
                "--artifacts",
                str(artifacts),
                "--workload",
                workload,
            ],
            cwd=code,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    found = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        lines = [line for line in out.splitlines() if line.startswith("RANK-PARTS ")]
        if proc.returncode or not lines:
            raise SystemExit(f"rank failed (exit {proc.returncode}) in {code}:\n{out[-3000:]}")
        found.append(json.loads(lines[-1].split(" ", 1)[1]))
    return {k: sum(f[k] for f in found) / len(found) for k in found[0]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--code", action="append", type=Path, help="a checkout to run (repeatable; default: this one)"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--artifacts", type=Path, default=REPO / "artifacts" / "tiny")
    p.add_argument("--rank-parts", action="store_true", help="one training rank's start-up, part by part")
    p.add_argument("--workload", default="quickstart", choices=["quickstart", "compute", "varlen"],
                   help="the quickstart, or a vs_trl.py workload")  # fmt: skip
    p.add_argument("--rank-child", nargs=2, type=int, help=argparse.SUPPRESS)  # rank, port (internal)
    a = p.parse_args()
    if a.rank_child:
        rank_child(a.rank_child[0], a.rank_child[1], workload_flags(a.workload, a.artifacts.resolve()))
        return
    if not (a.artifacts / "model" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "miles.tools.tiny_model", "--out", str(a.artifacts / "model"),
                        "--task", "echo", "--seed", "0", "--overwrite"], check=True, cwd=REPO)  # fmt: skip
    if not (a.artifacts / "echo.jsonl").exists():
        subprocess.run([sys.executable, "-m", "miles.tools.toy_data", "--task", "echo", "--out",
                        str(a.artifacts / "echo.jsonl"), "--n", "2000", "--seed", "0"], check=True, cwd=REPO)  # fmt: skip
    workload_flags(a.workload, a.artifacts.resolve())  # builds its model and prompts before any run
    for r in range(a.repeats):
        for code in a.code or [REPO]:
            if a.rank_parts:
                parts = rank_parts(code.resolve(), a.artifacts.resolve(), a.workload)
                text = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                print(f"[{code} run {r + 1}] rank CPU-s {sum(parts.values()):.2f}: {text}", flush=True)
                continue
            phases, by_role = run_once(code.resolve(), workload_flags(a.workload, a.artifacts.resolve()))
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_role.items(), key=lambda kv: -kv[1]))
            print(f"[{code} run {r + 1}] {phases}\n    CPU-s {sum(by_role.values()):.1f}: {cpu}", flush=True)


if __name__ == "__main__":
    main()
