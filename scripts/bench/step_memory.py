"""Where a CPU training rank's memory goes inside its train step, phase by phase (issue 30).

    python scripts/bench/step_memory.py [--workload compute] [--ranks 2] [--steps 2] [--torch-memory]

Runs `--ranks` FSDP trainer ranks as `train_step.py` does (the workload's model, a synthetic rollout batch of its
shape, the flags `vs_trl.py` passes) and, on rank 0, wraps the step's parts to log memory at the end of each:
the training forward (`forward_pack`), the loss (`loss_fn`), the backward (with the deferred gradient
reduce-scatter after the last micro-batch), the gradient clip and the optimizer step. Per phase it prints

- ``rss``: resident memory at the phase's end, and ``peak``: the highest resident memory during the phase
  (the kernel's high-water mark, reset at each phase start through /proc/self/clear_refs), MiB;
- ``anon``: anonymous resident memory at the end (what PSS counts for a rank: file pages are shared);
- ``malloc used`` / ``malloc free``: glibc's bytes in use and free-but-kept (heap plus mmapped chunks,
  `mallinfo2`), MiB: what is free memory that malloc keeps, not tensors.

`--torch-memory` adds a torch profiler table (profile_memory) of rank 0's last step: the operators that allocate
the most.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_workloads import WORKLOADS, build_model, get_workload  # noqa: E402
from train_step import miles_trainer, rank_samples  # noqa: E402

MiB = 1024 * 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def malloc_bytes() -> tuple[int, int] | None:
    """(bytes malloc has handed out, bytes it keeps free) over all arenas, or None outside glibc >= 2.33."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return m.uordblks + m.hblkhd, m.fordblks


def status_kib(*keys: str) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


class PhaseLog:
    """Memory at the end of each phase and its peak during it (VmHWM, reset at each phase start)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.step = -1

    @staticmethod
    def reset_peak() -> None:
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def record(self, phase: str, t0: float) -> None:
        s = status_kib("VmRSS", "VmHWM", "RssAnon")
        m = malloc_bytes() or (0, 0)
        self.rows.append({"step": self.step, "phase": phase, "s": time.perf_counter() - t0,
                          "rss": s["VmRSS"] / 1024, "peak": s["VmHWM"] / 1024, "anon": s["RssAnon"] / 1024,
                          "used": m[0] / MiB, "free": m[1] / MiB})  # fmt: skip

    def wrap(self, fn, phase):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            self.record("(before " + phase + ")", time.perf_counter())
            self.reset_peak()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.record(phase, t0)
            self.reset_peak()
            return out

        return inner


def instrument(trainer, log: PhaseLog) -> None:
    """Wrap the parts of rank 0's step (see the module docstring); the numbers do not change."""
    import torch

    from miles.backends.fsdp_utils import actor, model

    actor.forward_pack = log.wrap(actor.forward_pack, "forward")
    trainer.algo = type(trainer.algo)(
        **{**trainer.algo.__dict__, "loss_fn": log.wrap(trainer.algo.loss_fn, "loss")}
    )
    torch.Tensor.backward = log.wrap(torch.Tensor.backward, "backward")
    model.clip_grad_norm_sharded = log.wrap(model.clip_grad_norm_sharded, "clip")
    trainer.optimizer.step = log.wrap(trainer.optimizer.step, "optimizer")


def child(a: argparse.Namespace) -> None:
    import torch

    w = get_workload(a.workload)
    trainer = miles_trainer(a.model_dir, w, a.rank, a.ranks, a.flag)
    log = PhaseLog()
    if a.rank == 0:
        instrument(trainer, log)
    out = {"steps": []}
    for step in range(a.steps):
        log.step = step
        last = step == a.steps - 1
        prof = (
            torch.profiler.profile(profile_memory=True, record_shapes=True)
            if a.torch_memory and last and a.rank == 0
            else contextlib.nullcontext()
        )
        samples = rank_samples(w, a.model_dir, step, a.rank, a.ranks)
        PhaseLog.reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        with prof:
            trainer.train(step, samples)
        log.record("whole step", t0)
        log.rows[-1]["peak"] = max(r["peak"] for r in log.rows if r["step"] == step)
        out["steps"].append({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0})
        if a.torch_memory and last and a.rank == 0:
            table = prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_memory_usage",
                row_limit=25,
                max_name_column_width=40,
                max_shapes_column_width=60,
            )
            print(table, file=sys.stderr)
    out["rows"] = log.rows
    if a.malloc_info and a.rank == 0:
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        f = libc.fopen(a.malloc_info.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
    print(json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="compute", choices=sorted(WORKLOADS))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument(
        "--steps", type=int, default=2, help="train steps (the first one allocates everything anew)"
    )
    p.add_argument("--torch-memory", action="store_true", help="torch profiler allocations of the last step")
    p.add_argument("--model-dir", default=None, help="reuse this built model (built there when missing)")
    p.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for the ranks (e.g. MALLOC_* tunables)"
    )
    p.add_argument(
        "--malloc-info", default=None, help="rank 0 writes glibc's malloc_info XML here at the end"
    )
    p.add_argument(
        "--flag",
        action="append",
        default=[],
        help="an extra miles flag (repeat; e.g. --flag=--gradient-checkpointing)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a)
        return 0
    from miles.utils.net import free_port

    tmp = None
    if a.model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="step-memory-model-")
        a.model_dir = tmp.name
    if not os.path.exists(os.path.join(a.model_dir, "config.json")):
        build_model(get_workload(a.workload), a.model_dir)
    port, procs = str(free_port()), []
    extra = dict(kv.split("=", 1) for kv in a.env)
    for rank in range(a.ranks):
        env = {**os.environ, **extra, "RANK": str(rank), "WORLD_SIZE": str(a.ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        cmd = [sys.executable, __file__, "--child", "--rank", str(rank), "--model-dir", a.model_dir,
               "--workload", a.workload, "--ranks", str(a.ranks), "--steps", str(a.steps)]  # fmt: skip
        cmd += ["--torch-memory"] if a.torch_memory else []
        cmd += [f"--flag={f}" for f in a.flag]
        cmd += ["--malloc-info", a.malloc_info] if a.malloc_info else []
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=1800) for p in procs]
    for rank, (proc, (_, err)) in enumerate(zip(procs, outs)):
        if proc.returncode != 0:
            raise SystemExit(f"rank {rank} failed:\n{err[-4000:]}")
    if a.torch_memory:
        err = outs[0][1]
        print(err[err.find("-----") :])
    r = json.loads(outs[0][0].strip().splitlines()[-1])
    print(f"rank 0 of {a.ranks}, workload {a.workload}; MiB (peak: highest RSS during the phase)")
    print(
        f"{'step':>4} {'phase':<22} {'s':>6} {'rss':>7} {'peak':>7} {'anon':>7} {'m.used':>7} {'m.free':>7}"
    )
    for row in r["rows"]:
        if row["phase"].startswith("(before") and row["phase"] != "(before forward)":
            continue
        print(f"{row['step']:>4} {row['phase']:<22} {row['s']:6.2f} {row['rss']:7.0f} {row['peak']:7.0f} "
              f"{row['anon']:7.0f} {row['used']:7.0f} {row['free']:7.0f}")  # fmt: skip
    print("steps (wall, CPU s of rank 0):", " ".join(f"{s['wall']:.2f}/{s['cpu']:.2f}" for s in r["steps"]))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
