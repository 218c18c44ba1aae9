"""miles vs Hugging Face TRL's GRPOTrainer, side by side on this machine (issue 10).

    python scripts/bench/vs_trl.py [--workloads quickstart,compute,varlen] [--repeats 2] [--quick]

Both systems get the same model weights, tokenizer and prompt file (built here, see `bench_workloads.py`),
16 prompts x 8 samples per step, one optimizer step per rollout, the same response length limit, sampling
(temperature 1, no top-p/top-k), GRPO loss (clip 0.2/0.28, per-sequence token mean, std-normalised group
advantages, no KL), AdamW at the same constant lr, grad clip 1.0, the same micro-batch size, no data shuffling
(both see the same prompts in the same order) and the same reward function (miles' "math" reward).
- miles runs through its real entry point, `python -m miles.train` (Ray, embedded engines, FSDP2 actors), with
  the placement `--placement` names (default: the one that gave miles its best numbers here; see PLACEMENTS).
- TRL runs `GRPOTrainer` (transformers `generate`, which pads) in a subprocess of its own venv, created on first
  use by this script: `--system-site-packages` (the same torch and transformers as miles), TRL pinned.
Runs alternate A/B/A/B per workload. Per run: startup (launch until the first step begins), steady seconds per
step (median of the steps after `warmup_steps`), samples/s, the reward of the last step, the mean response length,
and the peak memory of the whole process tree (sum RSS, as asked, and sum PSS, which counts shared pages once).
The report gives each number's median [min-max] over repeats and the ratios miles/TRL. A JSON with every run
goes to `--out`. `--quick` shrinks every workload to a smoke check (small model, 3 steps, 1 repeat).

Run it alone: `flock /tmp/miles-heavy.lock python scripts/bench/vs_trl.py ...` on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from bench_workloads import WORKLOADS, Workload, build_model, get_workload, make_rows, write_rows  # noqa: E402
from benchlib import Spread, TimedRun, mib, run_timed, step_intervals, write_json_atomic  # noqa: E402

TRL_VERSION = "1.16.0"
SYSTEMS = ("miles", "trl")
# miles placements on a CPU box: (trainers, engines, colocated). "colocate2" is scripts/run-tiny-cpu.sh's.
PLACEMENTS: dict[str, tuple[int, int, bool]] = {
    "colocate2": (2, 2, True),
    "colocate1": (1, 1, True),
    "split1+1": (1, 1, False),
    "split1+2": (1, 2, False),
}
# Placement per workload that gave miles its best numbers here (quickstart: colocate2 1.7 s/step, colocate1
# 1.9, split1+1 2.0, within the noise of a shared machine; compute/varlen: see the issue-10 report).
DEFAULT_PLACEMENT = {"quickstart": "colocate2", "compute": "colocate2", "varlen": "colocate2"}
STEP_LINE = re.compile(r"^rollout (\d+): reward")


# ------------------------------------------------------------------------------------------------ records
@dataclass
class RunRecord:
    """One run of one system on one workload."""

    system: str
    workload: str
    repeat: int
    placement: str | None
    returncode: int
    wall_s: float
    startup_s: float  # launch until the first step begins
    step_end_s: list[float]  # seconds after launch at which each step ended
    rewards: list[float] = field(default_factory=list)  # mean reward per step
    response_lens: list[float] = field(default_factory=list)  # mean response length per step
    phases: dict[str, list[float]] = field(default_factory=dict)  # miles: timing/<phase> per step
    peak_rss: int = 0
    peak_pss: int = 0
    peak_procs: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None


@dataclass(frozen=True)
class SystemSummary:
    """One system on one workload, over its repeats."""

    step_s: Spread  # steady seconds per step (each repeat: the median of its steady steps)
    samples_per_s: Spread
    startup_s: Spread
    final_reward: Spread  # reward of the last step
    response_len: Spread  # mean response length over all steps
    response_tokens_per_s: Spread  # steady steps' response tokens / their seconds (fair when lengths drift)
    peak_rss_mib: Spread
    peak_pss_mib: Spread
    runs: int
    failed: int


def response_token_rate(
    step_end_s: list[float], response_lens: list[float], warmup: int, samples_per_step: int
) -> float | None:
    """Response tokens per second over the steady steps (step i's mean length x samples, over step i's time);
    None when the run did not report one length per step."""
    if len(response_lens) != len(step_end_s) or len(step_end_s) <= warmup:
        return None
    seconds = sum(step_intervals(step_end_s, warmup))
    tokens = sum(response_lens[warmup:]) * samples_per_step
    return tokens / seconds if seconds > 0 else None


def summarize_system(records: list[RunRecord], warmup: int, samples_per_step: int) -> SystemSummary:
    """Aggregate the successful runs of one system on one workload."""
    ok = [r for r in records if r.ok]
    per_run_step = []
    for r in ok:
        steps = step_intervals(r.step_end_s, warmup)
        per_run_step.append(Spread.of(steps).median)
    return SystemSummary(
        step_s=Spread.of(per_run_step),
        samples_per_s=Spread.of([samples_per_step / s for s in per_run_step if s > 0]),
        startup_s=Spread.of([r.startup_s for r in ok]),
        final_reward=Spread.of([r.rewards[-1] for r in ok if r.rewards]),
        response_len=Spread.of([sum(r.response_lens) / len(r.response_lens) for r in ok if r.response_lens]),
        response_tokens_per_s=Spread.of(
            [
                rate
                for r in ok
                if (rate := response_token_rate(r.step_end_s, r.response_lens, warmup, samples_per_step))
                is not None
            ]
        ),
        peak_rss_mib=Spread.of([mib(r.peak_rss) for r in ok]),
        peak_pss_mib=Spread.of([mib(r.peak_pss) for r in ok]),
        runs=len(records),
        failed=len(records) - len(ok),
    )


def pair_ratios(miles: list[RunRecord], trl: list[RunRecord], warmup: int) -> Spread:
    """miles/TRL samples/s (= TRL step time / miles step time) of each repeat's adjacent A/B pair."""
    by_repeat = {r.repeat: r for r in trl if r.ok}
    ratios = []
    for m in miles:
        t = by_repeat.get(m.repeat)
        if m.ok and t is not None:
            sm = Spread.of(step_intervals(m.step_end_s, warmup)).median
            st = Spread.of(step_intervals(t.step_end_s, warmup)).median
            ratios.append(st / sm)
    return Spread.of(ratios)


def format_report(
    workloads: list[Workload], records: list[RunRecord], placements: dict[str, str]
) -> tuple[str, dict]:
    """The printed report and its JSON form (per workload: both systems' summaries and the ratios)."""
    lines, out = [], {}
    for w in workloads:
        recs = [r for r in records if r.workload == w.name]
        m = summarize_system([r for r in recs if r.system == "miles"], w.warmup_steps, w.samples_per_step)
        t = summarize_system([r for r in recs if r.system == "trl"], w.warmup_steps, w.samples_per_step)
        pairs = pair_ratios([r for r in recs if r.system == "miles"], [r for r in recs if r.system == "trl"],
                            w.warmup_steps)  # fmt: skip
        ratio = (
            m.samples_per_s.median / t.samples_per_s.median
            if t.samples_per_s.n and m.samples_per_s.n
            else None
        )
        # best-of: each system's fastest repeat (the least disturbed one on a shared machine)
        best = m.samples_per_s.hi / t.samples_per_s.hi if t.samples_per_s.n and m.samples_per_s.n else None
        tok_ratio = (
            m.response_tokens_per_s.median / t.response_tokens_per_s.median
            if t.response_tokens_per_s.n and m.response_tokens_per_s.n
            else None
        )
        mem_ratio = (
            m.peak_pss_mib.median / t.peak_pss_mib.median if t.peak_pss_mib.n and m.peak_pss_mib.n else None
        )
        lines.append(f"== {w.name}: {w.description}")
        lines.append(
            f"   steps {w.steps} (steady: last {w.steps - w.warmup_steps}), {w.samples_per_step} samples/step, "
            f"max response {w.max_response_len}, miles placement {placements.get(w.name)}"
        )
        lines.append(f"   {'':8}{'s/step':>22}{'samples/s':>22}{'startup s':>20}{'reward@last':>20}"
                     f"{'resp len':>18}{'peak RSS MiB':>22}{'peak PSS MiB':>22}  runs")  # fmt: skip
        for name, s in (("miles", m), ("trl", t)):
            lines.append(
                f"   {name:8}{s.step_s.fmt():>22}{s.samples_per_s.fmt():>22}{s.startup_s.fmt():>20}"
                f"{s.final_reward.fmt(2):>20}{s.response_len.fmt():>18}{s.peak_rss_mib.fmt(4):>22}"
                f"{s.peak_pss_mib.fmt(4):>22}  {s.runs - s.failed}/{s.runs}"
            )
        r_txt = "n/a" if ratio is None else f"{ratio:.2f}x"
        mem_txt = "n/a" if mem_ratio is None else f"{mem_ratio:.2f}x"
        best_txt = "n/a" if best is None else f"{best:.2f}x"
        lines.append(
            f"   miles/TRL samples/s: {r_txt} (medians; best repeat of each: {best_txt}; per A/B pair: "
            f"{pairs.fmt()}); peak PSS miles/TRL: {mem_txt}"
        )
        if tok_ratio is not None:
            lines.append(
                f"   miles/TRL response tokens/s: {tok_ratio:.2f}x ({m.response_tokens_per_s.fmt()} vs "
                f"{t.response_tokens_per_s.fmt()}; the fair measure when the systems' response lengths differ)"
            )
        out[w.name] = {
            "workload": dataclasses.asdict(w),
            "placement": placements.get(w.name),
            "miles": dataclasses.asdict(m),
            "trl": dataclasses.asdict(t),
            "ratio_samples_per_s": ratio,
            "ratio_samples_per_s_best": best,
            "ratio_response_tokens_per_s": tok_ratio,
            "ratio_per_pair": dataclasses.asdict(pairs),
            "ratio_peak_pss": mem_ratio,
        }
    return "\n".join(lines), out


# ------------------------------------------------------------------------------------------------ TRL venv
def trl_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_trl_venv(venv: Path, version: str) -> str:
    """Create `venv` with TRL `version` unless its stamp says it is there; returns the versions line.

    `--system-site-packages`: the venv sees the system torch and transformers; a constraint file pins both to
    the installed versions so pip never pulls a CUDA torch or a different transformers. The stamp file is written
    last, so an interrupted install is redone from scratch.
    """
    import torch
    import transformers

    stamp = venv / ".miles-bench-stamp"
    want = f"trl=={version} torch=={torch.__version__} transformers=={transformers.__version__}"
    if stamp.is_file() and stamp.read_text().strip() == want:
        return want
    import shutil

    shutil.rmtree(venv, ignore_errors=True)
    print(f"[vs_trl] creating {venv} with {want} (first use; takes a minute)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    base_torch = torch.__version__.split("+")[0]
    constraints.write_text(f"torch=={base_torch}\ntransformers=={transformers.__version__}\n")
    subprocess.run(
        [str(trl_python(venv)), "-m", "pip", "install", "-q", "-c", str(constraints), f"trl=={version}"],
        check=True,
    )
    stamp.write_text(want + "\n")
    return want


# ------------------------------------------------------------------------------------------------ runs
def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        RAY_DEDUP_LOGS="1",
        PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p]),
    )
    return env


def miles_command(w: Workload, model: Path, data: Path, run_dir: Path, placement: str) -> list[str]:
    """`python -m miles.train ...` for workload `w` (same settings as trl_child.grpo_config_kwargs)."""
    trainers, engines, colocate = PLACEMENTS[placement]
    cmd = [
        sys.executable, "-m", "miles.train",
        "--hf-checkpoint", str(model), "--prompt-data", str(data),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
        "--num-rollout", str(w.steps), "--rollout-batch-size", str(w.n_prompts),
        "--n-samples-per-prompt", str(w.n_samples), "--rollout-max-response-len", str(w.max_response_len),
        "--rollout-temperature", "1.0",
        "--global-batch-size", str(w.samples_per_step), "--micro-batch-size", str(w.micro_batch_size),
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", str(w.lr), "--lr-decay-style", "constant", "--clip-grad", "1.0",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(trainers),
        "--rollout-num-gpus-per-engine", "1", "--train-backend", "fsdp",
        "--run-dir", str(run_dir), "--seed", "1", "--log-level", "WARNING",
    ]  # fmt: skip
    if w.chat:
        cmd.append("--apply-chat-template")
    cmd += ["--colocate"] if colocate else ["--rollout-num-gpus", str(engines)]
    return cmd


def run_miles(w: Workload, model: Path, data: Path, run_dir: Path, placement: str, repeat: int) -> RunRecord:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = miles_command(w, model, data, run_dir, placement)
    run = run_timed(cmd, base_env(), REPO, timeout_s=1800, log_path=run_dir / "output.log")
    rec = _record("miles", w, repeat, placement, run)
    ends = [t - run.launched_at for t, line in run.lines if STEP_LINE.match(line)]
    metrics = _read_metrics(run_dir / "metrics.jsonl")
    rec.step_end_s = ends
    rec.rewards = [float(m.get("rollout/raw_reward", "nan")) for m in metrics]
    rec.response_lens = [float(m.get("rollout/response_len", "nan")) for m in metrics]
    for key in ("rollout", "train", "refit"):
        rec.phases[key] = [float(m.get(f"timing/{key}", "nan")) for m in metrics]
    if ends and metrics:
        first = sum(float(v) for k, v in metrics[0].items() if k.startswith("timing/"))
        rec.startup_s = ends[0] - first
    return _check_steps(rec, w, run)


def run_trl(w: Workload, model: Path, data: Path, run_dir: Path, venv: Path, repeat: int) -> RunRecord:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = json.dumps(dataclasses.asdict(w))
    cmd = [str(trl_python(venv)), str(HERE / "trl_child.py"), "--model", str(model), "--data", str(data),
           "--spec", spec, "--out", str(run_dir / "trainer")]  # fmt: skip
    run = run_timed(cmd, base_env(), REPO, timeout_s=1800, log_path=run_dir / "output.log")
    rec = _record("trl", w, repeat, None, run)
    events = [
        json.loads(line[len("BENCH_EVENT ") :]) for _, line in run.lines if line.startswith("BENCH_EVENT ")
    ]
    begins = [e["time"] - run.launched_at for e in events if e["event"] == "step_begin"]
    rec.step_end_s = [e["time"] - run.launched_at for e in events if e["event"] == "step_end"]
    rec.startup_s = begins[0] if begins else float("nan")
    logs = [e["logs"] for e in events if e["event"] == "log" and "reward" in e["logs"]]
    rec.rewards = [float(lg["reward"]) for lg in logs]
    rec.response_lens = [float(lg.get("completions/mean_length", "nan")) for lg in logs]
    return _check_steps(rec, w, run)


def _record(system: str, w: Workload, repeat: int, placement: str | None, run: TimedRun) -> RunRecord:
    wall = (run.lines[-1][0] - run.launched_at) if run.lines else 0.0
    return RunRecord(
        system=system, workload=w.name, repeat=repeat, placement=placement, returncode=run.returncode,
        wall_s=wall, startup_s=float("nan"), step_end_s=[], peak_rss=run.peak_rss, peak_pss=run.peak_pss,
        peak_procs=run.peak_procs,
    )  # fmt: skip


def _check_steps(rec: RunRecord, w: Workload, run: TimedRun) -> RunRecord:
    if rec.returncode != 0:
        rec.error = f"exit code {rec.returncode}; last lines:\n{run.tail()}"
    elif len(rec.step_end_s) != w.steps:
        rec.error = f"saw {len(rec.step_end_s)} step ends, expected {w.steps}; last lines:\n{run.tail()}"
    return rec


def _read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workloads", default="quickstart,compute,varlen", help="comma-separated, of " + ",".join(WORKLOADS)
    )
    p.add_argument("--repeats", type=int, default=2, help="A/B pairs per workload")
    p.add_argument("--systems", default="miles,trl", help="comma-separated subset of miles,trl")
    p.add_argument(
        "--placement",
        default=None,
        choices=sorted(PLACEMENTS),
        help="miles placement for every workload (default: the best measured per workload)",
    )
    p.add_argument("--steps", type=int, default=None, help="override every workload's step count")
    p.add_argument("--quick", action="store_true", help="shrunk workloads, 3 steps, 1 repeat: a smoke check")
    p.add_argument("--trl-venv", default=str(REPO / ".venv-trl"), help="venv for TRL (created on first use)")
    p.add_argument("--trl-version", default=TRL_VERSION)
    p.add_argument(
        "--work-dir", default=None, help="models, data and run dirs (default: runs/bench-vs-trl-<utc>)"
    )
    p.add_argument("--out", default=None, help="report JSON (default: <work-dir>/report.json)")
    a = p.parse_args(argv)  # fmt: skip
    names = [n.strip() for n in a.workloads.split(",") if n.strip()]
    for n in names:
        if n not in WORKLOADS:
            p.error(f"--workloads: unknown workload {n!r}; choose from {sorted(WORKLOADS)}")
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        p.error(f"--systems {a.systems!r}: a comma-separated subset of {SYSTEMS}")
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: must be >= 1")
    if a.steps is not None and a.steps < 2:
        p.error(f"--steps {a.steps}: must be >= 2 (the first step is warm-up)")
    a.workload_names, a.system_names = names, systems
    if a.quick:
        a.repeats = 1
    return a


def resolve_workloads(a: argparse.Namespace) -> list[Workload]:
    """The selected workloads, shrunk by --quick and with --steps applied."""
    out = []
    for name in a.workload_names:
        w = get_workload(name)
        if a.quick:
            w = w.quick()
        if a.steps is not None:
            w = dataclasses.replace(w, steps=a.steps, warmup_steps=min(w.warmup_steps, a.steps - 1))
        out.append(w)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    workloads = resolve_workloads(a)
    work = Path(a.work_dir or REPO / "runs" / time.strftime("bench-vs-trl-%Y%m%d-%H%M%S", time.gmtime()))
    venv = Path(a.trl_venv)
    versions = ensure_trl_venv(venv, a.trl_version) if "trl" in a.system_names else None
    placements = {w.name: a.placement or DEFAULT_PLACEMENT[w.name] for w in workloads}
    print(f"[vs_trl] work dir {work}; {versions or 'miles only'}", flush=True)
    records: list[RunRecord] = []
    for w in workloads:
        model = build_model(w, work / w.name / "model")
        data = write_rows(make_rows(w, 4000, seed=0), work / w.name / "prompts.jsonl")
        for rep in range(a.repeats):
            for system in a.system_names:  # A/B/A/B
                run_dir = work / w.name / f"{system}-{rep}"
                if system == "miles":
                    rec = run_miles(w, model, data, run_dir, placements[w.name], rep)
                else:
                    rec = run_trl(w, model, data, run_dir, venv, rep)
                records.append(rec)
                steps = step_intervals(rec.step_end_s, w.warmup_steps) if rec.ok else []
                print(
                    f"[vs_trl] {w.name} {system} #{rep}: "
                    + (f"steady {Spread.of(steps).fmt()} s/step, startup {rec.startup_s:.1f}s, "
                       f"reward {rec.rewards[-1] if rec.rewards else float('nan'):.3f}, "
                       f"peak RSS {mib(rec.peak_rss):.0f} MiB / PSS {mib(rec.peak_pss):.0f} MiB "
                       f"({rec.peak_procs} procs)" if rec.ok else f"FAILED: {rec.error}"),
                    flush=True,
                )  # fmt: skip
    text, summary = format_report(workloads, records, placements)
    print(text, flush=True)
    out = Path(a.out) if a.out else work / "report.json"
    write_json_atomic(
        {
            "versions": versions,
            "quick": a.quick,
            "summary": summary,
            "runs": [dataclasses.asdict(r) for r in records],
        },
        out,
    )
    print(f"[vs_trl] report: {out}", flush=True)
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
