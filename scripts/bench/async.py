"""The three drivers side by side on a long-tailed workload (issue 25, item 6).

    python scripts/bench/async.py [--placements 1+1,1+2] [--repeats 2] [--quick] [--steps N (default 30)]

One workload, ``longtail``: a tiny untied Qwen3 whose EOS logit is designed (``bench_workloads.schedule_eos``,
"prompt_timed") so that a response ends after a number of tokens set by the prompt's run of markers; the marker
counts are lognormal with sigma 1.0, so the response lengths are long-tailed (a few groups run ~10x the median; the
report prints the measured median/p90/max from the synchronous runs' `--dump-details`). The task is the echo task
(`echo 3 3 3 3` -> '3') with miles' math reward; the same prompt file, model, seed and settings for every driver.

Drivers (`DRIVERS`): `python -m miles.train` (synchronous), `python -m miles.train_async` (one-step-off) and
`python -m miles.train_async --fully-async` with `FULLY_ASYNC_ARGS` (a staleness bound, TIS, in-place pauses and a
refit every second step, as docs/async.md recommends for this workload; `--fully-async-args` replaces them;
`--variant NAME=FLAGS` adds more fully async configurations to each round). Placements: 1 trainer + 1 engine and 1 trainer + 2 engines,
disaggregated. For each placement and repeat the drivers run A/B/C in turn
(repeat r uses seed `--seed` + r for all three). Per run, over the steady steps (after `warmup_steps`):
- samples/s: samples trained in the steady steps / the seconds between the end of the last warm-up step and the
  end of the last step (step ends are the driver's `rollout N: reward` lines);
- engine busy fraction, measured on the engine side: the bench reads each embedded engine's port from
  `<run-dir>/logs/engine_*.log` and polls its `GET /get_load` every `--poll-s` seconds; an engine is busy at a
  poll when it has a running request; the fraction is over the steady window, averaged over engines (a request
  frozen by an `in_place` pause counts as running, so that mode reads slightly high);
- trainer busy fraction: sum of `timing/train` of the steady steps / the steady window;
- staleness mean and max: from `async/staleness_mean` / `async/staleness_max` in metrics.jsonl (fully async);
  the other two drivers have none and get their values by construction (synchronous 0, one-step-off 1 after the
  first step), marked `*`;
- trained response tokens/s and mean response length over the steady steps (the work per sample grows as the
  policy learns, at a pace that differs between seeds and drivers), and decoded/trained: the engines' decode
  tokens over the trained responses' decoded tokens, whole run (above 1 by the work never trained);
- reward after the same number of samples: `rollout/raw_reward` of the last step (every driver trains
  `steps` x batch samples), and the means over the last quarter and over the second half of the steps (less
  noisy: `reward_means`);
- where a steady step's time went (`PHASES`: the trainer's wait for a batch, train, refit and, fully async, the
  pause / refit / continue split and the generation worker's clock) and each engine's cumulative decode, prefill
  and retract counters (`ENGINE_STATS`, read from `GET /get_server_info` every `STATS_EVERY_S`; their growth
  over the steady window gives the engines' requests per decode step and time per token), printed under each
  run's line and kept in report.json;
- CPU: the run's process tree is read from /proc every `CPU_EVERY_S` (utime + stime per process) and split by
  kind (`process_kind`: trainer, engines, rollout manager, driver, Ray's own); over the steady window the report
  gives the cores each kind used, the CPU-ms per trained sample, and the cores the rest of the machine used
  meanwhile (/proc/stat, less the bench's own process; above `NOT_QUIET_CORES` the report says the machine was not quiet). Per placement it
  prints the ceiling those imply on fully async / sync samples/s: cores / sync's cores used (fully async at
  sync's CPU per sample, every core busy) and cores / fully async's CPU-s per sample / sync's samples/s.
The report gives medians [min-max] over repeats and the ratios fully async / synchronous of samples/s and of
response tokens/s.
`--quick` is a smoke check (fewer steps, 1 repeat, shorter tail). Run it alone on a shared machine:
`flock /tmp/miles-heavy.lock python scripts/bench/async.py ...`; CPU timings are only indicative.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import secrets
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from bench_workloads import WORKLOADS, Workload, build_model, make_rows, write_rows  # noqa: E402
from benchlib import Spread, cpu_delta, run_timed, step_intervals, write_json_atomic  # noqa: E402
from vs_trl import STEP_LINE, base_env, miles_command  # noqa: E402

# name -> (module, extra flags)
DRIVERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sync": ("miles.train", ()),
    "one_step_off": ("miles.train_async", ()),
    "fully_async": ("miles.train_async", ("--fully-async",)),
}
BENCH_PLACEMENTS = {
    "1+1": "split1+1",
    "1+2": "split1+2",
}  # -> vs_trl.PLACEMENTS (trainers, engines, colocate)
STALENESS_BY_CONSTRUCTION = {"sync": 0.0, "one_step_off": 1.0}
STATS_EVERY_S = 0.25  # the poller reads each engine's cumulative counters (/get_server_info) this often
ENGINE_STATS = ("decode_seconds", "decode_tokens", "decode_steps", "prefill_tokens", "retracted_requests")
# docs/async.md recommends for fully async on this workload: a staleness bound (pacing + check), TIS against the
# rollout log-probs for the off-policy gap, in-place pauses (no re-prefill of the running requests after a refit)
# and a refit every second step (half the pauses; the bound still holds); `--fully-async-args` replaces it
FULLY_ASYNC_ARGS = (
    "--max-weight-staleness 2 --use-tis --pause-generation-mode in_place --update-weights-interval 2"
)
# per-step phases of metrics.jsonl averaged over the steady steps (fully async adds the pause / refit / continue
# split and where its generation worker's time went: docs/async.md "Where the time goes")
PHASES = ("timing/rollout", "timing/train", "timing/refit", "timing/async_pause", "timing/async_refit",
          "timing/async_continue", "timing/async_worker/generating_samples", "timing/async_worker/idle_s",
          "timing/async_worker/buffer_full_s", "timing/async_worker/pacing_stall_s",
          "timing/async_worker/paused_s", "timing/async_worker/wait_for_due_s")  # fmt: skip
# the process tree's CPU time is read every CPU_EVERY_S and split by kind of process (`process_kind`)
CPU_EVERY_S = 0.5
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# the rest of the machine busier than this (cores) in the runs: the report says its CPU numbers are not quiet
NOT_QUIET_CORES = 0.15
PROCESS_KINDS = ("trainer", "engines", "rollout manager", "driver", "ray")
ENGINE_LINE = re.compile(r"embedded engine serving .* on ([\w.\-]+):(\d+)\s*$")

LONGTAIL = dataclasses.replace(
    WORKLOADS["varlen"],
    name="longtail",
    description="tiny Qwen3, EOS after a prompt-set length, lognormal(sigma 1) marker counts: long-tailed lengths",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    intermediate_size=None,
    max_response_len=256,
    lr=1e-4,
    n_prompts=8,
    n_samples=4,
    micro_batch_size=32,
    marker_median=12.0,
    marker_sigma=1.0,
    steps=30,
    warmup_steps=2,
)


def quick_workload(w: Workload) -> Workload:
    """`--quick`: 6 steps (2 warm-up: the async drivers' first step is slow and lets generation run ahead), the
    tail capped at 96 tokens."""
    return dataclasses.replace(w, steps=6, warmup_steps=2, max_response_len=96, marker_median=8.0)


# ------------------------------------------------------------------------------------------------ pure parts
def parse_metrics(text: str) -> list[dict]:
    """The per-step dicts of a metrics.jsonl text, in step order."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return sorted(rows, key=lambda m: m.get("step", 0))


def engine_address(log_text: str) -> str | None:
    """`http://host:port` of the embedded engine whose log this is (None until it logged that it serves)."""
    for line in log_text.splitlines():
        m = ENGINE_LINE.search(line)
        if m:
            return f"http://{m.group(1)}:{m.group(2)}"
    return None


def steady_window(step_end_s: list[float], warmup: int) -> tuple[float, float]:
    """(start, end) seconds after launch of the steady steps: end of step `warmup - 1` to end of the last."""
    if warmup < 1 or len(step_end_s) <= warmup:
        raise ValueError(f"need more than warmup={warmup} (>= 1) step ends, got {len(step_end_s)}")
    return step_end_s[warmup - 1], step_end_s[-1]


def samples_per_s(step_end_s: list[float], warmup: int, samples_per_step: int) -> float:
    seconds = sum(step_intervals(step_end_s, warmup))
    return (len(step_end_s) - warmup) * samples_per_step / seconds


def busy_fraction(polls: list[tuple[float, bool]], start: float, end: float) -> float:
    """Share of the polls (time, busy) inside [start, end] that found the engine busy (NaN if none did poll)."""
    inside = [busy for t, busy in polls if start <= t <= end]
    return sum(inside) / len(inside) if inside else float("nan")


def trainer_busy(metrics: list[dict], step_end_s: list[float], warmup: int) -> float:
    """Sum of the steady steps' `timing/train` over the steady window."""
    start, end = steady_window(step_end_s, warmup)
    train = sum(float(m.get("timing/train", 0.0)) for m in metrics[warmup : len(step_end_s)])
    return train / (end - start)


def staleness(metrics: list[dict], driver: str, warmup: int) -> tuple[float, float, bool]:
    """(mean, max, measured) over the steady steps: from `async/staleness_*` when the run logged them, else the
    driver's value by construction (measured False)."""
    steady = metrics[warmup:]
    means = [float(m["async/staleness_mean"]) for m in steady if "async/staleness_mean" in m]
    if means:
        return statistics.fmean(means), max(float(m["async/staleness_max"]) for m in steady), True
    value = STALENESS_BY_CONSTRUCTION.get(base_driver(driver), float("nan"))
    return value, value, False


def steady_phases(metrics: list[dict], warmup: int) -> dict[str, float]:
    """Mean over the steady steps of each of `PHASES` the run logged."""
    steady = metrics[warmup:]
    return {
        k: statistics.fmean(float(m[k]) for m in steady)
        for k in PHASES
        if steady and all(k in m for m in steady)
    }


def counter_delta(history: list[tuple[float, dict]], key: str, start: float, end: float) -> float:
    """How much the cumulative engine counter `key` grew over [start, end], from the (time, counters) readings
    in `history` (time order), each end linearly interpolated between the readings around it (held flat
    outside them); NaN without readings."""
    if not history:
        return float("nan")

    def at(t: float) -> float:
        prev = None
        for ti, stats in history:
            v = float(stats.get(key, 0.0))
            if ti >= t:
                if prev is None or ti == prev[0]:
                    return v
                return prev[1] + (v - prev[1]) * (t - prev[0]) / (ti - prev[0])
            prev = (ti, v)
        return prev[1] if prev else float("nan")

    return at(end) - at(start)


def steady_counts(metrics: list[dict], step_lengths: list[list[int]], warmup: int) -> dict[str, float]:
    """Over the steady steps: trained samples and response tokens (from --dump-details) and the response tokens
    of groups generated and never trained (`async/discarded_tokens`, fully async with a bound)."""
    steady = step_lengths[warmup:]
    return {
        "samples": float(sum(len(x) for x in steady)),
        "tokens": float(sum(sum(x) for x in steady)),
        "discarded_tokens": sum(float(m.get("async/discarded_tokens", 0.0)) for m in metrics[warmup:]),
    }


def length_stats(lengths: list[int]) -> dict[str, float]:
    """median, p90, max, and max/median of response lengths."""
    if not lengths:
        return {}
    xs = sorted(lengths)
    med = statistics.median(xs)
    p90 = xs[max(0, math.ceil(0.9 * len(xs)) - 1)]  # nearest rank
    return {"n": len(xs), "median": med, "p90": p90, "max": xs[-1], "max_over_median": xs[-1] / med}


def reward_means(rewards: list[float]) -> tuple[float, float, float]:
    """(last step, mean of the last quarter, mean of the second half) of the per-step rewards. On this workload a
    step's reward is a mean over 32 samples at p ~0.1 (binomial SD ~0.05), so the last step says little and the
    last quarter (7 of 30 steps) moves by ~0.02 on sampling alone; the second half is the least noisy of the
    three while still 'after the same number of samples' in the sense of the target."""
    if not rewards:
        return float("nan"), float("nan"), float("nan")
    tail = rewards[-max(1, len(rewards) // 4) :]
    half = rewards[len(rewards) // 2 :]
    return rewards[-1], statistics.fmean(tail), statistics.fmean(half)


def process_kind(cmdline: str) -> str:
    """Which of `PROCESS_KINDS` a process of a run's tree is, from its command line: the training ranks and the
    rollout manager are Ray actors (`ray::TrainWorker`, `ray::RolloutManager`), the split placement's engines
    `python -m miles.engines.local` processes, the driver `python -m miles.train[_async]` (with the engine
    fleet and Ray's log monitor on its threads); the rest is Ray's (gcs, raylet, agents, idle workers, other
    actors)."""
    if "ray::" in cmdline:
        actor = cmdline.split("ray::", 1)[1].split()[0].split(".")[0] if cmdline.split("ray::", 1)[1] else ""
        return {"TrainWorker": "trainer", "RolloutManager": "rollout manager"}.get(actor, "ray")
    args = cmdline.split()
    if "-m" in args and args.index("-m") + 1 < len(args):
        module = args[args.index("-m") + 1]
        if module == "miles.engines.local":
            return "engines"
        if module in ("miles.train", "miles.train_async"):
            return "driver"
    return "ray"


def cpu_cores_by_kind(
    per_pid_s: dict[int, float], cmdlines: dict[int, str], seconds: float
) -> dict[str, float]:
    """Cores used per `PROCESS_KINDS` (CPU-seconds of its processes / `seconds`), plus "total"."""
    out = dict.fromkeys(PROCESS_KINDS, 0.0)
    for pid, secs in per_pid_s.items():
        out[process_kind(cmdlines.get(pid, ""))] += secs / seconds
    out["total"] = sum(out.values())
    return out


def ceilings(
    sync_sps: float, sync_cores: float, fa_sps: float, fa_cores: float, cores: int
) -> dict[str, float]:
    """What fully async could reach on `cores` cores, as ratios to sync's samples/s: `by_cores` if it kept
    sync's CPU per sample and used every core (cores / sync's cores used); `by_own_cpu` with its own CPU per
    sample (cores / fully async's CPU-s per sample, over sync's samples/s). NaN where an input is missing."""
    nan = float("nan")
    if not all(x == x and x > 0 for x in (sync_sps, sync_cores)):
        return {"by_cores": nan, "by_own_cpu": nan}
    own = nan
    if fa_sps == fa_sps and fa_cores == fa_cores and fa_sps > 0 and fa_cores > 0:
        own = cores / (fa_cores / fa_sps) / sync_sps
    return {"by_cores": cores / sync_cores, "by_own_cpu": own}


# ------------------------------------------------------------------------------------------------ runs
class EnginePoller:
    """Polls `GET /get_load` of every engine that has logged its address under `log_dir`, from a thread."""

    def __init__(self, log_dir: Path, interval: float, t0: float, api_key: str, engines: int) -> None:
        self.log_dir, self.interval, self.t0, self.engines = log_dir, interval, t0, engines
        # engine -> its /get_server_info internal states (cumulative counters), with the seconds after t0
        self.history: dict[str, list[tuple[float, dict]]] = {}
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.polls: dict[str, list[tuple[float, bool]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-poller", daemon=True)

    def __enter__(self) -> EnginePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _addresses(self) -> list[str]:
        out = []
        for log in sorted(self.log_dir.glob("engine_*.log")):
            addr = engine_address(log.read_text(errors="replace"))
            if addr:
                out.append(addr)
        return out

    def _get(self, url: str) -> object:
        with urllib.request.urlopen(urllib.request.Request(url, headers=self.headers), timeout=2) as r:
            return json.loads(r.read())

    def _run(self) -> None:
        addrs: list[str] = []
        last_stats = 0.0
        while not self._stop.wait(self.interval):
            if len(addrs) < self.engines:  # engines come up one by one (their logs are read until all have)
                addrs = self._addresses()
            stats_due = time.time() - last_stats >= STATS_EVERY_S
            last_stats = time.time() if stats_due else last_stats
            for addr in addrs:
                try:
                    load = self._get(f"{addr}/get_load")
                    if stats_due:
                        state = self._get(f"{addr}/get_server_info")["internal_states"][0]
                        self.history.setdefault(addr, []).append((time.time() - self.t0, state))
                except (OSError, ValueError, KeyError, IndexError, TypeError):
                    continue
                busy = any(d.get("num_running", 0) > 0 for d in load)
                self.polls.setdefault(addr, []).append((time.time() - self.t0, busy))


@dataclass
class Run:
    driver: str
    placement: str
    repeat: int
    seed: int
    returncode: int
    step_end_s: list[float] = field(default_factory=list)
    samples_per_s: float = float("nan")
    engine_busy: float = float("nan")
    trainer_busy: float = float("nan")
    staleness_mean: float = float("nan")
    staleness_max: float = float("nan")
    staleness_measured: bool = False
    reward_last: float = float("nan")
    reward_tail: float = float("nan")
    reward_half: float = float("nan")  # mean over the second half of the steps (`reward_means`)
    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    step_lengths: list[float] = field(default_factory=list)  # mean trained response length per step
    resp_len: float = float("nan")  # mean trained response length over the steady steps
    tokens_per_s: float = float("nan")  # trained response tokens / s over the steady window
    decode_per_trained: float = float("nan")  # engine decode tokens / trained decode tokens, steady window
    # the same over the whole run (the engines' last counters): above 1 by the work never trained (groups in
    # flight or buffered at the end, and discarded ones); the steady window's also moves with the work ahead
    decode_per_trained_run: float = float("nan")
    steady_engine: dict[str, float] = field(default_factory=dict)  # ENGINE_STATS grown in the steady window
    steady: dict[str, float] = field(default_factory=dict)  # steady_counts
    phases: dict[str, float] = field(default_factory=dict)  # PHASES: steady-step means
    engine_stats: dict[str, float] = field(default_factory=dict)  # ENGINE_STATS, summed over engines
    cpu_cores: float = float("nan")  # cores the run's process tree used over the steady window
    cpu_kinds: dict[str, float] = field(default_factory=dict)  # cpu_cores_by_kind over the steady window
    cpu_ms_per_sample: float = float("nan")  # the tree's CPU-ms per trained sample, steady window
    cpu_others: float = float(
        "nan"
    )  # cores the rest of the machine used meanwhile (not this bench's process)
    error: str | None = None


def base_driver(driver: str) -> str:
    """The `DRIVERS` entry a run's driver name stands for: `fully_async[NAME]` (a `--variant`) is fully async."""
    return driver.split("[", 1)[0]


def parse_variants(specs: list[str]) -> dict[str, str]:
    """`--variant NAME=FLAGS` (repeatable) -> {"fully_async[NAME]": FLAGS}: more fully async configurations, run
    interleaved with the others (each replaces `--fully-async-args` for its runs)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not re.fullmatch(r"[\w.+-]+", name) or f"fully_async[{name}]" in out:
            raise ValueError(f"--variant {spec!r}: NAME=FLAGS, NAME unique, of letters, digits, '_.+-'")
        out[f"fully_async[{name}]"] = flags
    return out


def driver_command(w: Workload, driver: str, model: Path, data: Path, run_dir: Path, placement: str, seed: int,
                   fully_async_args: list[str]) -> list[str]:  # fmt: skip
    """vs_trl's miles command for `w`, through `driver`'s module, with --dump-details; `fully_async_args` go to
    the fully async driver (and its variants) only."""
    module, extra = DRIVERS[base_driver(driver)]
    cmd = miles_command(w, model, data, run_dir, BENCH_PLACEMENTS[placement], seed)
    cmd[cmd.index("miles.train")] = module
    cmd += [*extra, "--dump-details", str(run_dir / "details")]
    return cmd + (fully_async_args if base_driver(driver) == "fully_async" else [])


def run_one(w: Workload, driver: str, placement: str, repeat: int, seed: int, paths: tuple[Path, Path, Path],
            a: argparse.Namespace) -> Run:  # fmt: skip
    model, data, run_dir = paths
    run_dir.mkdir(parents=True, exist_ok=True)
    flags = a.variants.get(driver, a.fully_async_args)
    cmd = driver_command(w, driver, model, data, run_dir, placement, seed, flags.split())
    key = secrets.token_hex(16)  # this run's engine key (MILES_ENGINE_API_KEY), so the poller may ask them
    t0 = time.time()
    engines = int(placement.split("+")[1])
    with EnginePoller(run_dir / "logs", a.poll_s, t0, key, engines) as poller:
        env = {**base_env(), "MILES_ENGINE_API_KEY": key}
        proc = run_timed(cmd, env, REPO, timeout_s=a.timeout_s, log_path=run_dir / "output.log",
                         cpu_interval=CPU_EVERY_S)  # fmt: skip
    rec = Run(driver, placement, repeat, seed, proc.returncode)
    rec.step_end_s = [t - proc.launched_at for t, line in proc.lines if STEP_LINE.match(line)]
    if proc.returncode != 0 or len(rec.step_end_s) != w.steps:
        rec.error = f"exit {proc.returncode}, {len(rec.step_end_s)}/{w.steps} steps:\n{proc.tail(25)}"
        return rec
    path = run_dir / "metrics.jsonl"
    metrics = parse_metrics(path.read_text()) if path.is_file() else []
    shift = t0 - proc.launched_at  # poll times are after t0, step ends after launch
    start, end = steady_window(rec.step_end_s, w.warmup_steps)
    fracs = [busy_fraction([(t + shift, b) for t, b in p], start, end) for p in poller.polls.values()]
    rec.samples_per_s = samples_per_s(rec.step_end_s, w.warmup_steps, w.samples_per_step)
    rec.engine_busy = statistics.fmean(fracs) if fracs else float("nan")
    rec.trainer_busy = trainer_busy(metrics, rec.step_end_s, w.warmup_steps)
    rec.staleness_mean, rec.staleness_max, rec.staleness_measured = staleness(metrics, driver, w.warmup_steps)
    rec.rewards = [float(m.get("rollout/raw_reward", "nan")) for m in metrics]
    rec.reward_last, rec.reward_tail, rec.reward_half = reward_means(rec.rewards)
    rec.phases = steady_phases(metrics, w.warmup_steps)
    if proc.cpu is not None and proc.cpu.history:
        rec.cpu_kinds = cpu_cores_by_kind(
            cpu_delta(proc.cpu.history, start, end), proc.cpu.cmdlines, end - start
        )
        rec.cpu_cores = rec.cpu_kinds["total"]
        rec.cpu_ms_per_sample = 1e3 * rec.cpu_cores / rec.samples_per_s
        machine, own = (cpu_delta([(t, {0: x}) for t, x in xs], start, end).get(0, float("nan"))
                        for xs in (proc.cpu.machine, proc.cpu.own))  # fmt: skip
        rec.cpu_others = (machine - own) / (end - start) - rec.cpu_cores
    rec.engine_stats = {k: sum(float(h[-1][1].get(k, 0.0)) for h in poller.history.values() if h)
                        for k in ENGINE_STATS}  # fmt: skip
    rec.steady_engine = {k: sum(counter_delta([(t + shift, st) for t, st in h], k, start, end)
                                for h in poller.history.values()) for k in ENGINE_STATS}  # fmt: skip
    per_step = [[json.loads(line)["response_length"] for line in f.read_text().splitlines() if line]
                for f in sorted((run_dir / "details").glob("rollout_*.jsonl"))]  # fmt: skip
    rec.lengths = [n for step in per_step for n in step]
    rec.step_lengths = [statistics.fmean(step) if step else float("nan") for step in per_step]
    rec.steady = steady_counts(metrics, per_step, w.warmup_steps)
    if rec.lengths:
        rec.decode_per_trained_run = rec.engine_stats["decode_tokens"] / (sum(rec.lengths) - len(rec.lengths))
    if rec.steady["samples"]:
        rec.resp_len = rec.steady["tokens"] / rec.steady["samples"]
        rec.tokens_per_s = rec.steady["tokens"] / (end - start)
        # a response's first token comes from the prefill, the rest from decode steps
        rec.decode_per_trained = rec.steady_engine["decode_tokens"] / (
            rec.steady["tokens"] - rec.steady["samples"]
        )
    return rec


# ------------------------------------------------------------------------------------------------ report
COLUMNS = (("samples/s", "samples_per_s", 3), ("resp tokens/s", "tokens_per_s", 3), ("resp len", "resp_len", 3),
           ("decoded/trained", "decode_per_trained_run", 3), ("CPU cores", "cpu_cores", 3),
           ("engine busy", "engine_busy", 2), ("trainer busy", "trainer_busy", 2),
           ("stale mean", "staleness_mean", 2), ("stale max", "staleness_max", 2),
           ("reward@last", "reward_last", 2), ("reward last 1/4", "reward_tail", 2),
           ("reward 2nd half", "reward_half", 2))  # fmt: skip


def format_report(w: Workload, runs: list[Run], placements: list[str]) -> tuple[str, dict]:
    lines = [f"== {w.name}: {w.description}",
             f"   {w.steps} steps (steady: last {w.steps - w.warmup_steps}), {w.samples_per_step} samples/step, "
             f"max response {w.max_response_len}; medians [min-max] over repeats; * = by construction"]  # fmt: skip
    lens = length_stats([n for r in runs if r.driver == "sync" for n in r.lengths])
    if lens:
        lines.append("   response lengths (sync runs): " + ", ".join(f"{k} {v:.3g}" for k, v in lens.items()))
    out: dict = {"lengths": lens}
    for p in placements:
        lines.append(f"-- placement {p} (trainers+engines, disaggregated)")
        lines.append(f"   {'driver':22}" + "".join(f"{c:>22}" for c, _, _ in COLUMNS) + "  runs")
        table: dict = {}
        for d in dict.fromkeys(r.driver for r in runs):  # in the order they ran
            rs = [r for r in runs if r.placement == p and r.driver == d]
            if not rs:
                continue
            ok = [r for r in rs if r.error is None]
            cols = {key: Spread.of([getattr(r, key) for r in ok]) for _, key, _ in COLUMNS}
            star = "" if any(r.staleness_measured for r in ok) else "*"
            cells = [cols[k].fmt(dig) + (star if k.startswith("staleness") else "") for _, k, dig in COLUMNS]
            lines.append(f"   {d:22}" + "".join(f"{c:>22}" for c in cells) + f"  {len(ok)}/{len(rs)}")
            table[d] = {k: dataclasses.asdict(v) for k, v in cols.items()}
        ratio, tok_ratio = (
            _ratio(table, "fully_async", "sync", k) for k in ("samples_per_s", "tokens_per_s")
        )
        lines.append(f"   fully async / sync samples/s: {ratio:.2f}x (target >= 1.5x); response tokens/s: "
                     f"{tok_ratio:.2f}x (the same work per sample only if resp len matches)")  # fmt: skip
        out[p] = {"drivers": table, "ratio_fully_async_over_sync": ratio, "tokens_ratio": tok_ratio}
        lines += cpu_lines(runs, p, table, ratio, out[p])
        for d in [d for d in table if d.startswith("fully_async[")]:
            r_s, r_t = (_ratio(table, d, "sync", k) for k in ("samples_per_s", "tokens_per_s"))
            lines.append(f"   {d} / sync samples/s: {r_s:.2f}x; response tokens/s: {r_t:.2f}x")
            out[p][f"ratio_{d}_over_sync"] = r_s
    return "\n".join(lines), out


def cpu_lines(runs: list[Run], p: str, table: dict, ratio: float, out: dict) -> list[str]:
    """Per driver (medians over its runs): the cores its tree used by kind of process and the cores the rest of
    the machine used meanwhile, then the CPU-ms per sample by kind (what contention moves least); then the
    ceilings on fully async's samples/s ratio that the CPU allows (`ceilings`), next to the measured ratio."""
    lines = [f"   CPU over the steady window (medians): cores used of {CORES}; CPU-ms per trained sample"]
    others: list[float] = []
    for d in table:
        ok = [r for r in runs if r.placement == p and r.driver == d and r.error is None and r.cpu_kinds]
        if not ok:
            continue
        others += [r.cpu_others for r in ok]
        cores = {k: Spread.of([r.cpu_kinds.get(k, float("nan")) for r in ok]).median for k in PROCESS_KINDS}
        ms = {k: Spread.of([1e3 * r.cpu_kinds.get(k, float("nan")) / r.samples_per_s for r in ok]).median
              for k in PROCESS_KINDS}  # fmt: skip
        lines.append(f"     {d:22} cores {Spread.of([r.cpu_cores for r in ok]).fmt(3)} (others "
                     f"{Spread.of([r.cpu_others for r in ok]).median:.2f}): " + ", ".join(
                         f"{k} {cores[k]:.2f}" for k in PROCESS_KINDS))  # fmt: skip
        lines.append(f"     {'':22} CPU-ms/sample {Spread.of([r.cpu_ms_per_sample for r in ok]).fmt(3)}: "
                     + ", ".join(f"{k} {ms[k]:.2f}" for k in PROCESS_KINDS))  # fmt: skip
    get = {d: {k: table.get(d, {}).get(k, {}).get("median", float("nan"))
               for k in ("samples_per_s", "cpu_cores")} for d in ("sync", "fully_async")}  # fmt: skip
    c = ceilings(get["sync"]["samples_per_s"], get["sync"]["cpu_cores"], get["fully_async"]["samples_per_s"],
                 get["fully_async"]["cpu_cores"], CORES)  # fmt: skip
    out["cpu_ceiling"] = c
    lines.append(f"   ceiling on fully async / sync samples/s: {c['by_cores']:.2f}x at sync's CPU per sample "
                 f"({CORES} cores / sync's cores used), {c['by_own_cpu']:.2f}x at fully async's own CPU per "
                 f"sample; measured {ratio:.2f}x")  # fmt: skip
    busy = Spread.of(others).median
    if busy > NOT_QUIET_CORES:
        lines.append(f"   (not a quiet machine: other processes used {busy:.2f} cores meanwhile; cores used, the "
                     "ceilings and the speed ratios move with that load, CPU-ms per sample least)")  # fmt: skip
    return lines


def _ratio(table: dict, a: str, b: str, key: str) -> float:
    """median `key` of driver a / that of driver b (NaN when either is missing)."""
    nan = {key: {"median": float("nan")}}
    x, y = table.get(a, nan)[key]["median"], table.get(b, nan)[key]["median"]
    return x / y if x == x and y == y and y > 0 else float("nan")


def engine_line(r: Run) -> str:
    """The engines' steady-window decode work: tokens, steps, mean running requests per decode step, the time
    per step and per token, prefill tokens, retracts."""
    e = r.steady_engine
    steps, toks, secs = e.get("decode_steps", 0.0), e.get("decode_tokens", 0.0), e.get("decode_seconds", 0.0)
    if not steps or not toks:
        return "engines (steady): no counters"
    return (f"engines (steady): {toks:.0f} decode tokens in {steps:.0f} steps, {toks / steps:.1f} running per "
            f"step, {1e3 * secs / steps:.2f} ms/step, {1e6 * secs / toks:.0f} us/token; prefill "
            f"{e.get('prefill_tokens', 0):.0f}, retracted {e.get('retracted_requests', 0):.0f}; trained "
            f"{r.steady.get('tokens', 0):.0f} response tokens, discarded "
            f"{r.steady.get('discarded_tokens', 0):.0f}")  # fmt: skip


def detail_lines(r: Run) -> str:
    """What a run's line is followed by: the steady step's phases, the trained responses, the engines' work."""
    phases = ", ".join(f"{k.removeprefix('timing/')} {v:.3g}" for k, v in r.phases.items())
    return (f"    per step: {phases}\n    trained: {r.tokens_per_s:.0f} response tokens/s, mean length "
            f"{r.resp_len:.1f} (per step: {' '.join(f'{x:.0f}' for x in r.step_lengths)}); decoded/trained "
            f"{r.decode_per_trained_run:.3f} (run), {r.decode_per_trained:.3f} (steady)\n    {engine_line(r)}"
            f"\n    {cpu_line(r)}")  # fmt: skip


def cpu_line(r: Run) -> str:
    """The cores the run's process tree used over the steady window, by kind, and its CPU-ms per sample."""
    if not r.cpu_kinds:
        return "cpu (steady): not sampled"
    kinds = ", ".join(f"{k} {r.cpu_kinds.get(k, 0.0):.2f}" for k in PROCESS_KINDS)
    return (f"cpu (steady): {r.cpu_cores:.2f} of {CORES} cores ({kinds}); others {r.cpu_others:.2f}; "
            f"{r.cpu_ms_per_sample:.1f} CPU-ms/sample")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--placements", default="1+1,1+2", help="comma-separated, of " + ",".join(BENCH_PLACEMENTS)
    )
    p.add_argument("--drivers", default=",".join(DRIVERS), help="comma-separated, of " + ",".join(DRIVERS))
    p.add_argument("--repeats", type=int, default=2, help="A/B/C rounds per placement")
    p.add_argument("--steps", type=int, default=None, help="override the workload's step count")
    p.add_argument("--seed", type=int, default=1, help="seed of repeat 0; repeat r uses seed + r")
    p.add_argument(
        "--fully-async-args",
        default=FULLY_ASYNC_ARGS,
        help=f"extra flags for the fully async driver (one string; default {FULLY_ASYNC_ARGS!r})",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another fully async configuration, run after the drivers in each round as fully_async[NAME] with "
        "FLAGS instead of --fully-async-args (repeatable), e.g. --variant inplace='--max-weight-staleness 2 "
        "--use-tis --pause-generation-mode in_place'",
    )
    p.add_argument("--poll-s", type=float, default=0.05, help="engine /get_load polling interval")
    p.add_argument("--timeout-s", type=float, default=1800, help="per-run timeout")
    p.add_argument("--quick", action="store_true", help="6 steps, 1 repeat, shorter tail: a smoke check")
    p.add_argument("--work-dir", default=None, help="default: runs/bench-async-<utc>")
    a = p.parse_args(argv)
    a.placement_names = [x.strip() for x in a.placements.split(",") if x.strip()]
    a.driver_names = [x.strip() for x in a.drivers.split(",") if x.strip()]
    if not a.placement_names or any(x not in BENCH_PLACEMENTS for x in a.placement_names):
        p.error(f"--placements {a.placements!r}: a comma-separated subset of {sorted(BENCH_PLACEMENTS)}")
    if not a.driver_names or any(x not in DRIVERS for x in a.driver_names):
        p.error(f"--drivers {a.drivers!r}: a comma-separated subset of {list(DRIVERS)}")
    try:
        a.variants = parse_variants(a.variant)
    except ValueError as e:
        p.error(str(e))
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: must be >= 1")
    if a.steps is not None and a.steps < 2:
        p.error(f"--steps {a.steps}: must be >= 2 (the first step is warm-up)")
    if a.quick:
        a.repeats = 1
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    w = quick_workload(LONGTAIL) if a.quick else LONGTAIL
    if a.steps is not None:
        w = dataclasses.replace(w, steps=a.steps, warmup_steps=min(w.warmup_steps, a.steps - 1))
    work = Path(a.work_dir or REPO / "runs" / time.strftime("bench-async-%Y%m%d-%H%M%S", time.gmtime()))
    model = build_model(w, work / "model")
    data = write_rows(make_rows(w, 4000, seed=0), work / "prompts.jsonl")
    print(f"[async] work dir {work}", flush=True)
    runs: list[Run] = []
    for placement in a.placement_names:
        for rep in range(a.repeats):
            for driver in [*a.driver_names, *a.variants]:  # A/B/C
                seed = a.seed + rep
                run_dir = work / placement / f"{driver.replace('[', '-').rstrip(']')}-{rep}"
                r = run_one(w, driver, placement, rep, seed, (model, data, run_dir), a)
                runs.append(r)
                print(f"[async] {placement} {driver} #{rep} (seed {seed}): " + (
                    f"{r.samples_per_s:.2f} samples/s, engine busy {r.engine_busy:.2f}, trainer busy "
                    f"{r.trainer_busy:.2f}, staleness {r.staleness_mean:.2f}/{r.staleness_max:.0f}, reward "
                    f"{r.reward_last:.3f}" if r.error is None else f"FAILED: {r.error}"), flush=True)  # fmt: skip
                if r.error is None:
                    print(detail_lines(r), flush=True)
    text, summary = format_report(w, runs, a.placement_names)
    print(text, flush=True)
    out = work / "report.json"
    write_json_atomic({"quick": a.quick, "workload": dataclasses.asdict(w), "summary": summary,
                       "runs": [dataclasses.asdict(r) for r in runs]}, out)  # fmt: skip
    print(f"[async] report: {out}", flush=True)
    return 0 if all(r.error is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
