"""Refit bandwidth of the CPU colocated path vs a memcpy of the same bytes, in the same run (issue 10).

    python scripts/bench/refit.py [--workload compute] [--trainers 1] [--bucket-mb 512] [--repeats 5]
                                  [--transport window|handles] [--release-resume] [--timeline]

Real processes, miles' own code on both sides: `--trainers` FSDP2 training ranks (gloo, `build_fsdp_model`)
refit `--trainers` embedded engines (`python -m miles.engines.local`, one intra-op thread each, as miles starts
them on CPU), engine e served by rank e, through the transport `FSDPTrainer.update_weights` picks in a colocated
CPU run of embedded engines: `--transport window` (default) is `WindowWeightUpdater` (the shared-memory weight
window, one `/update_weights_from_window` per refit); `--transport handles` is `ColocatedWeightUpdater` ->
`/update_weights_from_tensor` per bucket (shared-memory tensor handles, what SGLang engines get). The model is a
workload model of `bench_workloads.py` (default: the 25M-parameter one, ~100 MB in fp32).

Each refit is timed on rank 0 between barriers (all buckets, every engine answered); with `--release-resume` the
engines release weights and KV cache before it and the timed part starts with their resume, as a colocated step's
refit phase does. Bytes = model bytes x
engines. After each refit rank 0 copies a buffer of the same size (`dst.copy_(src)`), so refits and copies
alternate and a machine that gets busier or quieter mid-run moves both. The copy runs with as many intra-op threads
as all training ranks together (each has cpu_count / trainers, as `FSDPTrainer` sets on CPU): the reference gets
every core the refit may use, never fewer.
Printed: refit s and GB/s (median [min-max] over repeats after one warm-up), memcpy GB/s, and the ratio
refit/memcpy.

Run it alone: `flock /tmp/miles-heavy.lock python scripts/bench/refit.py` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from benchlib import Spread, write_json_atomic  # noqa: E402

from miles.utils.net import free_port  # noqa: E402


@dataclass(frozen=True)
class RefitResult:
    """What rank 0 measured."""

    model_bytes: int
    engines: int
    buckets: int
    bucket_bytes: int
    refit_s: list[float]  # per timed refit (after the warm-up one)
    memcpy_s: list[float]  # per timed copy of model_bytes * engines
    memcpy_threads: int
    transport: str = "handles"


@dataclass(frozen=True)
class RefitSummary:
    bytes: int
    refit_gbps: Spread
    memcpy_gbps: Spread
    ratio: float  # median refit GB/s / median memcpy GB/s
    refit_s: Spread


def summarize(r: RefitResult) -> RefitSummary:
    """GB/s (1e9 bytes/s) of each timed refit and copy, their medians and the refit/memcpy ratio."""
    total = r.model_bytes * r.engines
    refit = Spread.of([total / s / 1e9 for s in r.refit_s if s > 0])
    copy = Spread.of([total / s / 1e9 for s in r.memcpy_s if s > 0])
    ratio = refit.median / copy.median if copy.n and refit.n else float("nan")
    return RefitSummary(
        bytes=total, refit_gbps=refit, memcpy_gbps=copy, ratio=ratio, refit_s=Spread.of(r.refit_s)
    )


def format_summary(s: RefitSummary, r: RefitResult) -> str:
    return (
        f"refit ({r.transport}): {s.bytes / 1e6:.1f} MB to {r.engines} engine(s) in {r.buckets} bucket(s) of <= "
        f"{r.bucket_bytes / 2**20:.0f} MiB: {s.refit_s.fmt()} s = {s.refit_gbps.fmt()} GB/s\n"
        f"memcpy of the same bytes ({r.memcpy_threads} thread(s)): {s.memcpy_gbps.fmt()} GB/s\n"
        f"refit / memcpy bandwidth: {s.ratio:.4f}"
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine {url} exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"engine {url} not healthy within {timeout_s} s (phase: startup)")


def _rank_main(rank: int, world: int, port: int, model: str, urls: list[str], a: dict, out: str) -> None:
    """One training rank: FSDP2 model, `repeats + 1` refits (the first untimed), then rank 0 times memcpy."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed
    from miles.refit.buckets import plan_weight_buckets
    from miles.refit.session import RefitSetup
    from miles.refit.tensor_handles import ColocatedWeightUpdater
    from miles.utils.engine_control_http import post_to_engines

    trainer_threads = max(1, (os.cpu_count() or 1) // world)  # what FSDPTrainer sets on CPU
    torch.set_num_threads(trainer_threads)
    ps = init_distributed("gloo", timeout_s=600)
    net = build_fsdp_model(model, ps.fsdp_mesh, device=torch.device("cpu"))
    from miles.refit.window import WindowWeightUpdater

    kind = WindowWeightUpdater if a["transport"] == "window" else ColocatedWeightUpdater
    setup = RefitSetup(
        urls, ranks_per_engine=1, rank=rank, world_size=world, timeout_s=600, check_equal=a["check_equal"]
    )
    updater = kind(setup)
    spans: list[dict[str, float]] = []  # --timeline: per refit, seconds per part
    if a["timeline"]:
        _time_parts(updater, spans)
    bucket_bytes = int(a["bucket_mb"] * 2**20)
    tensors = {id(t): t for t in net.state_dict(keep_vars=True).values()}  # tied tensors once, as the updater
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())  # full (DTensor) sizes
    if rank == 0:  # the memcpy reference: the same bytes, copied between the refits (drift hits both alike)
        src = torch.randint(0, 255, (model_bytes * len(urls),), dtype=torch.uint8)
        dst = torch.empty_like(src)
    copy_threads = trainer_threads * world  # every core the ranks' refit may use together
    times, copies = [], []
    tags = {"tags": ["weights", "kv_cache"]}
    for i in range(a["repeats"] + 1):
        if a["release_resume"] and rank == 0:  # what the engines do around training in a colocated step
            post_to_engines(urls, "release_memory_occupation", tags, {}, 600, "bench release")
        dist.barrier()
        t0 = time.perf_counter()
        if a["release_resume"]:  # resumed as the ranks do in a colocated step (`Refitter.update`)
            folded = tags["tags"] if a["fold_resume"] else []  # the window's load carries them (steady state)
            updater.resume_engines(
                urls,
                lambda targets: post_to_engines(targets, "resume_memory_occupation", tags, {}, 600, "resume"),
                folded,
            )
        n_buckets = updater.update(net, bucket_bytes, weight_version=f"bench-{i}", dtype=torch.float32)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
        elif spans:
            spans.clear()  # the warm-up refit maps the windows: not steady state
        if rank == 0:
            torch.set_num_threads(copy_threads)
            t0 = time.perf_counter()
            dst.copy_(src)
            if i:
                copies.append(time.perf_counter() - t0)
            torch.set_num_threads(trainer_threads)
            # libgomp's workers spin for a while after a parallel region (tens of ms of `pause` on recent x86):
            # let them stop before the next refit, which must not share the cores with the reference's leftovers
            time.sleep(0.05)
    if spans:
        print(format_timeline(rank, spans), flush=True)
    if rank == 0:
        plan = plan_weight_buckets(net, bucket_bytes, torch.float32)
        assert len(plan) == n_buckets
        result = RefitResult(
            model_bytes, len(urls), n_buckets, bucket_bytes, times, copies, copy_threads, a["transport"]
        )
        Path(out).write_text(json.dumps(asdict(result)))
    dist.barrier()
    dist.destroy_process_group()


def _time_parts(updater: object, spans: list[dict[str, float]]) -> None:
    """Time the parts of each refit of ``updater`` on this rank (--timeline): ``agree`` (the error-flag
    collectives, waiting for the slowest rank included), ``http`` (the engine calls, window transport:
    `/update_weights_from_window` and its answer) and ``rest`` (the whole refit less those: plan and copies)."""
    cls = type(updater)

    def wrap(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if spans:
                    spans[-1][name] = spans[-1].get(name, 0.0) + time.perf_counter() - t0

        return timed

    refit = cls.push

    def timed_refit(self: object, *args: object, **kwargs: object) -> object:
        spans.append({})
        t0 = time.perf_counter()
        try:
            return refit(self, *args, **kwargs)
        finally:
            part = spans[-1]
            part["total"] = time.perf_counter() - t0
            part["rest"] = part["total"] - part.get("agree", 0.0) - part.get("http", 0.0)

    updater.push = types.MethodType(timed_refit, updater)  # type: ignore[attr-defined]
    agree = "_agree" if hasattr(updater, "_agree") else "raise_together"  # window: host flags or gloo
    setattr(updater, agree, wrap("agree", getattr(updater, agree)))
    for name in ("_load", "_post"):  # window: one load per engine; handles: one post per bucket
        if hasattr(updater, name):
            setattr(updater, name, wrap("http", getattr(updater, name)))


def format_timeline(rank: int, spans: list[dict[str, float]]) -> str:
    """Median ms of each part over the timed refits of one rank."""
    parts = ("total", "rest", "agree", "http")
    return f"rank {rank} refit ms (median over {len(spans)}): " + " ".join(
        f"{p} {1e3 * statistics.median(s.get(p, 0.0) for s in spans):.2f}" for p in parts
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench_workloads import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="compute", choices=sorted(WORKLOADS), help="whose model to refit")
    p.add_argument("--trainers", type=int, default=1, help="training ranks = colocated engines")
    p.add_argument(
        "--bucket-mb", type=float, default=512.0, help="refit bucket size in MiB (miles' default 512)"
    )
    p.add_argument("--repeats", type=int, default=10, help="timed refits (after one warm-up)")
    p.add_argument(
        "--transport",
        default="window",
        choices=("window", "handles"),
        help="window: the shared-memory weight window; handles: per-bucket tensor handles",
    )
    p.add_argument(
        "--release-resume",
        action="store_true",
        help="as in a colocated step: engines release weights and KV cache before each refit, and the timed "
        "refit starts with their resume (the driver's refit phase, less its Ray call)",
    )
    p.add_argument(
        "--no-fold-resume",
        dest="fold_resume",
        action="store_false",
        help="with --release-resume: resume in a call of its own before the load (before the window's load "
        "carried the tags)",
    )
    p.add_argument(
        "--check-equal",
        action="store_true",
        help="compare per-tensor checksums after each refit (miles' default, --check-weight-update-equal)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print each rank's median ms per part of a refit (plan and copies, agreement, engine calls)",
    )
    p.add_argument("--work-dir", default=None, help="where the model is written (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    if a.trainers < 1:
        p.error(f"--trainers {a.trainers}: must be >= 1")
    if a.bucket_mb <= 0:
        p.error(f"--bucket-mb {a.bucket_mb}: must be > 0")
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch.multiprocessing as mp
    from bench_workloads import build_model, get_workload

    with tempfile.TemporaryDirectory(prefix="miles-bench-refit-") as tmp:
        work = Path(a.work_dir or tmp)
        model = build_model(get_workload(a.workload), work / f"{a.workload}-model")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        engines, urls = [], []
        try:
            for _ in range(a.trainers):
                port = free_port()
                cmd = [sys.executable, "-m", "miles.engines.local", "--model-path", str(model), "--port", str(port),
                       "--num-threads", "1", "--log-level", "warning"]  # fmt: skip
                engines.append(subprocess.Popen(cmd, env=env, cwd=REPO))
                urls.append(f"http://127.0.0.1:{port}")
            for url, proc in zip(urls, engines):
                wait_healthy(url, proc, timeout_s=300)
            result_path = work / "refit-result.json"
            ctx = mp.spawn(
                _rank_main,
                args=(a.trainers, free_port(), str(model), urls, vars(a), str(result_path)),
                nprocs=a.trainers,
                join=False,
            )
            # poll the ranks' exit codes (waitpid): torch's shared-memory manager, a daemon the refit starts,
            # inherits the ranks' status pipes, so waiting on those (`join`) would not return while it lives
            deadline = time.monotonic() + 1800
            while any(p.exitcode is None for p in ctx.processes) and time.monotonic() < deadline:
                time.sleep(0.2)
            for rank, proc in enumerate(ctx.processes):
                if proc.exitcode is None:
                    proc.kill()
                    raise RuntimeError(f"training rank {rank} still running after 1800 s (phase: refit)")
                if proc.exitcode != 0:
                    raise RuntimeError(
                        f"training rank {rank} exited with code {proc.exitcode} (phase: refit)"
                    )
            result = RefitResult(**json.loads(result_path.read_text()))
        finally:
            for proc in engines:
                proc.terminate()
            for proc in engines:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    summary = summarize(result)
    print(format_summary(summary, result), flush=True)
    if a.out:
        write_json_atomic({"result": asdict(result), "summary": asdict(summary)}, Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
