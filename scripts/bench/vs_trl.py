"""miles vs Hugging Face TRL's GRPOTrainer, side by side on this machine (issue 10).

    python scripts/bench/vs_trl.py [--workloads quickstart,compute,varlen] [--repeats 2] [--quick]

Both systems get the same model weights, tokenizer and prompt file (built here, see `bench_workloads.py`),
16 prompts x 8 samples per step, one optimizer step per rollout, the same response length limit, sampling
(temperature 1, no top-p/top-k), GRPO loss (clip 0.2/0.28, per-sequence token mean, std-normalised group
advantages, no KL), AdamW (the same betas, eps, no weight decay) at the same constant lr, grad clip 1.0, the same
micro-batch size, no data shuffling (both see the same prompts in the same order) and the same reward function
(miles' "math" reward, on the response text without special tokens). The shared values live in
`bench_workloads.SHARED`; the report prints each system's *effective* settings side by side (miles': its config as
`miles.train` parses the command; TRL's: read off the built trainer, its generation config and its optimizer)
and marks any row where they differ. Repeat r runs both systems with seed `--seed` + r, so the repeats sample
different seeds (a seed is each system's own random stream: equal seeds do not give equal samples).
- miles runs through its real entry point, `python -m miles.train` (Ray, embedded engines, FSDP2 actors), with
  the placement `--placement` names (default: the one that gave miles its best numbers here; see PLACEMENTS).
- TRL runs `GRPOTrainer` (transformers `generate`, which pads) in a subprocess of its own venv, created on first
  use by this script over this interpreter's packages (the same torch and transformers as miles), TRL pinned.
Runs alternate A/B/A/B per workload. Per run: startup (launch until the first step begins), steady seconds per
step (median of the steps after `warmup_steps`), samples/s, the reward of the last step, the mean response length,
and the peak memory of the whole process tree (sum RSS, as asked, and sum PSS, which counts shared pages once).
The report gives each number's median [min-max] over repeats and the ratios miles/TRL, both systems' reward curves
(mean over seeds) and each seed's reward at the last step. A JSON with every run (and its per-step rewards) goes
to `--out`. `--quick` shrinks every workload to a smoke check (small model, 3 steps, 1 repeat).

Reward after N steps is a noisy number, mostly from the seed: on the quickstart workload (40 steps), ten TRL seeds
ended at 0.19 (seed 1), 0.52, 0.77, 0.83, 0.85, 0.93, 0.94, 0.95, 0.96, 0.98 and nine miles seeds at 0.39 (seed 8),
0.61, 0.66, 0.70, 0.77, 0.80, 0.84, 0.91, 0.98, their mean curves within 0.06 of each other at steps 1/10/20/30/40.
TRL's 0.19 run had collapsed onto the answer "00" for every prompt (the reward is then the share of prompts whose
label is 0), miles' 0.39 run half-way onto the same answer. Both trainers take the same step on the same batch
(scripts/bench/grad_vs_trl.py), so compare the curves over seeds, not one seed's last step.

Run it alone: `flock /tmp/miles-heavy.lock python scripts/bench/vs_trl.py ...` on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from bench_workloads import (  # noqa: E402
    SHARED,
    WORKLOADS,
    Workload,
    build_model,
    format_settings,
    get_workload,
    lr_per_step_text,
    make_rows,
    optimizer_text,
    sampling_text,
    settings_mismatches,
    write_rows,
)
from benchlib import Spread, TimedRun, mib, run_timed, step_intervals, write_json_atomic  # noqa: E402
from trl_child import EVENT  # noqa: E402

TRL_VERSION = "1.16.0"
STAMP = ".miles-bench-stamp"  # in the TRL venv, written once its install finished
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
    seed: int  # both systems' seed in this repeat (miles: --seed and --rollout-seed)
    placement: str | None
    returncode: int
    wall_s: float
    startup_s: float  # launch until the first step begins
    step_end_s: list[float]  # seconds after launch at which each step ended
    rewards: list[float] = field(default_factory=list)  # mean reward per step
    response_lens: list[float] = field(default_factory=list)  # mean response length per step
    phases: dict[str, list[float]] = field(default_factory=dict)  # miles: timing/<phase> per step
    settings: dict[str, str] = field(default_factory=dict)  # by bench_workloads.SETTING_ROWS, effective
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


def reward_curve(records: list[RunRecord]) -> list[float]:
    """Mean reward per step over the successful runs (as long as the shortest of them)."""
    runs = [r.rewards for r in records if r.ok and r.rewards]
    if not runs:
        return []
    n = min(len(x) for x in runs)
    return [sum(x[i] for x in runs) / len(runs) for i in range(n)]


def curve_steps(n: int) -> list[int]:
    """1-based steps at which the report prints a reward curve of `n` steps: the first, the quarters, the last."""
    return sorted({1, *(max(1, round(n * q)) for q in (0.25, 0.5, 0.75)), n}) if n else []


def reward_lines(records: list[RunRecord]) -> tuple[list[str], dict[str, object]]:
    """The report's reward lines for one workload: both systems' mean curves at `curve_steps`, and each seed's
    reward at the last step (one seed can land far from the others: on the quickstart workload a run now and
    then collapses onto one answer for every prompt); and their JSON form."""
    curves = {s: reward_curve([r for r in records if r.system == s]) for s in SYSTEMS}
    n = min((len(c) for c in curves.values() if c), default=0)
    steps = curve_steps(n)
    lines = [f"   reward by step (mean over seeds), steps {'/'.join(map(str, steps))}: " + " | ".join(
        f"{s} " + " ".join(f"{c[i - 1]:.2f}" for i in steps) for s, c in curves.items() if c
    )]  # fmt: skip
    by_seed = {
        s: {r.seed: r.rewards[-1] for r in records if r.system == s and r.ok and r.rewards} for s in SYSTEMS
    }
    lines.append("   reward@last by seed: " + " | ".join(
        f"{s} " + " ".join(f"s{k}:{v:.2f}" for k, v in sorted(d.items())) for s, d in by_seed.items() if d
    ))  # fmt: skip
    return lines, {"reward_curve": curves, "reward_at_last_by_seed": by_seed}


def settings_lines(records: list[RunRecord]) -> tuple[list[str], dict[str, object]]:
    """The settings table of one workload (from the first successful run of each system that reported its
    settings) and its JSON form, with the rows where the systems differ."""
    first = {
        s: next((r.settings for r in records if r.system == s and r.ok and r.settings), None) for s in SYSTEMS
    }
    m, t = first["miles"], first["trl"]
    if m is None or t is None:
        return [], {"miles": m, "trl": t}
    differ = settings_mismatches(m, t)
    head = "   effective settings" + (
        f" (DIFFER: {', '.join(differ)})" if differ else " (the same on both sides)"
    )
    return [head, *format_settings(m, t, indent="     ")], {"miles": m, "trl": t, "mismatches": differ}


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
        s_lines, s_json = settings_lines(recs)
        lines += s_lines
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
        r_lines, r_json = reward_lines(recs)
        lines += r_lines
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
            "settings": s_json,
            **r_json,
        }
    return "\n".join(lines), out


# ------------------------------------------------------------------------------------------------ TRL venv
def trl_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_trl_venv() -> Path | None:
    """The TRL venv that checks outside a benchmark run use: `$MILES_TRL_VENV`, else the default `--trl-venv`;
    None unless `ensure_trl_venv` finished installing it (its stamp file is there)."""
    venv = Path(os.environ.get("MILES_TRL_VENV", REPO / ".venv-trl"))
    return venv if (venv / STAMP).is_file() and trl_python(venv).is_file() else None


# What the TRL side imports: trl_child.py, grad_vs_trl.py's TRL side, miles' math reward
TRL_CHECK = (
    "import datasets, torch, transformers, trl, trl_child, grad_vs_trl, miles.rollout.rm_hub.math_utils"
)


def ensure_trl_venv(venv: Path, version: str) -> str:
    """Make `venv` with TRL `version` unless its stamp says it is there; returns the versions line.

    A side venv of this interpreter (scripts/side_venv.py): it runs this interpreter's torch, transformers and
    miles dependencies (a venv's or the system's) and adds TRL and what TRL needs on top, every package this
    interpreter has pinned to its version, so pip never pulls a CUDA torch or another transformers. Ready only
    once `TRL_CHECK` imports there; raises RuntimeError naming the log otherwise.
    """
    from importlib.metadata import version as installed

    sys.path.insert(0, str(REPO / "scripts"))
    import side_venv

    reqs = [f"trl=={version}", "datasets", "torch", "transformers", *side_venv.project_dependencies()]
    ok = side_venv.make(
        venv, STAMP, reqs, check=TRL_CHECK, check_path=[str(HERE), str(REPO)],
        log=lambda msg: print(f"[vs_trl] {msg}", flush=True),
    )  # fmt: skip
    if not ok:
        raise RuntimeError(f"cannot make the TRL venv {venv}: see {venv / side_venv.ERROR_LOG}")
    return f"trl=={version} torch=={installed('torch')} transformers=={installed('transformers')}"


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


def miles_command(
    w: Workload, model: Path, data: Path, run_dir: Path, placement: str, seed: int = 1
) -> list[str]:
    """`python -m miles.train ...` for workload `w` (same settings as trl_child.grpo_config_kwargs); `seed` seeds
    both the trainer (`--seed`) and the sampling (`--rollout-seed`)."""
    trainers, engines, colocate = PLACEMENTS[placement]
    s = SHARED
    cmd = [
        sys.executable, "-m", "miles.train",
        "--hf-checkpoint", str(model), "--prompt-data", str(data),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
        "--num-rollout", str(w.steps), "--rollout-batch-size", str(w.n_prompts),
        "--n-samples-per-prompt", str(w.n_samples), "--rollout-max-response-len", str(w.max_response_len),
        "--rollout-temperature", str(s.temperature), "--rollout-top-p", str(s.top_p),
        "--global-batch-size", str(w.samples_per_step), "--micro-batch-size", str(w.micro_batch_size),
        "--advantage-estimator", "grpo", "--eps-clip", str(s.eps_clip), "--eps-clip-high", str(s.eps_clip_high),
        "--optimizer", "adam", "--lr", str(w.lr), "--lr-decay-style", "constant", "--clip-grad", str(s.clip_grad),
        "--adam-beta1", str(s.adam_beta1), "--adam-beta2", str(s.adam_beta2), "--adam-eps", str(s.adam_eps),
        "--weight-decay", str(s.weight_decay),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(trainers),
        "--rollout-num-gpus-per-engine", "1", "--train-backend", "fsdp",
        "--run-dir", str(run_dir), "--seed", str(seed), "--rollout-seed", str(seed), "--log-level", "WARNING",
    ]  # fmt: skip
    if s.skip_special_tokens:
        cmd.append("--rollout-skip-special-tokens")
    if w.chat:
        cmd.append("--apply-chat-template")
    cmd += ["--colocate"] if colocate else ["--rollout-num-gpus", str(engines)]
    return cmd


def miles_settings(cmd: list[str], model: Path) -> dict[str, str]:
    """miles' effective settings for `cmd` (a `miles_command`) row by row of `bench_workloads.SETTING_ROWS` (but
    "lr logged per step", read off the run's metrics): its config parsed as `miles.train` parses it; the stop ids
    as the engine takes them (the model config's EOS ids and the tokenizer's, plus --rollout-stop-token-ids)."""
    from transformers import AutoConfig, AutoTokenizer

    from miles.config import parse_config

    cfg = parse_config(cmd[3:])
    r, t, o, al = cfg.rollout, cfg.train, cfg.optim, cfg.algo
    assert r.rollout_batch_size is not None and t.global_batch_size is not None  # required flags
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    eos = AutoConfig.from_pretrained(model).eos_token_id
    stop = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    stop |= {AutoTokenizer.from_pretrained(model).eos_token_id} - {None}
    stop |= set(r.rollout_stop_token_ids or [])
    if al.advantage_estimator == "grpo":
        adv = "group mean" if al.disable_grpo_std_normalization else "group mean / group std"
    else:
        adv = al.advantage_estimator
    if al.normalize_advantages:
        adv += ", whitened over the batch"
    loss = f"PPO clip {al.eps_clip:g}/{al.eps_clip_high:g}, {al.loss_reduction}"
    if al.eps_clip_c is not None:
        loss += f", dual clip {al.eps_clip_c:g}"
    if al.entropy_coef:
        loss += f", entropy bonus {al.entropy_coef:g}"
    kl = []
    if al.use_kl_loss and al.kl_loss_coef:
        kl.append(f"loss {al.kl_loss_type} x{al.kl_loss_coef:g}")
    if al.kl_coef:
        kl.append(f"reward x{al.kl_coef:g}")
    optim = "AdamW" if o.optimizer == "adam" else o.optimizer
    return {
        "prompts x samples per rollout": f"{r.rollout_batch_size} x {r.n_samples_per_prompt}",
        "samples per optimizer step": str(t.global_batch_size),
        "optimizer steps per rollout": str(samples // t.global_batch_size),
        "micro-batch (samples)": str(t.micro_batch_size),
        "prompt format": "chat template" if cfg.data.apply_chat_template else "plain text",
        "prompt order": "shuffled" if cfg.data.rollout_shuffle else "file order",
        "sampling": sampling_text(r.rollout_temperature, r.rollout_top_p, r.rollout_top_k, None, None),
        "max response tokens": str(r.rollout_max_response_len),
        "stop token ids": str(sorted(stop)),
        "reward text": "special tokens dropped" if r.rollout_skip_special_tokens else "special tokens kept",
        "advantages": adv,
        "policy loss": loss,
        "KL": ", ".join(kl) or "off",
        "optimizer": optimizer_text(optim, (o.adam_beta1, o.adam_beta2), o.adam_eps, o.weight_decay),
        "grad clip": f"{o.clip_grad:g}",
        "lr schedule": f"{o.lr:g} {o.lr_decay_style}, warmup {o.lr_warmup_iters} steps",
        "seed": f"{cfg.seed} (sampling {r.rollout_seed})",
    }


def run_miles(
    w: Workload, model: Path, data: Path, run_dir: Path, placement: str, repeat: int, seed: int
) -> RunRecord:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = miles_command(w, model, data, run_dir, placement, seed)
    settings = miles_settings(cmd, model)
    run = run_timed(cmd, base_env(), REPO, timeout_s=1800, log_path=run_dir / "output.log")
    rec = _record("miles", w, repeat, placement, run, seed)
    ends = [t - run.launched_at for t, line in run.lines if STEP_LINE.match(line)]
    metrics = _read_metrics(run_dir / "metrics.jsonl")
    rec.step_end_s = ends
    rec.rewards = [float(m.get("rollout/raw_reward", "nan")) for m in metrics]
    rec.response_lens = [float(m.get("rollout/response_len", "nan")) for m in metrics]
    rec.settings = {
        **settings,
        "lr logged per step": lr_per_step_text([float(m.get("train/lr", "nan")) for m in metrics]),
    }
    for key in ("rollout", "train", "refit"):
        rec.phases[key] = [float(m.get(f"timing/{key}", "nan")) for m in metrics]
    if ends and metrics:
        first = sum(float(v) for k, v in metrics[0].items() if k.startswith("timing/"))
        rec.startup_s = ends[0] - first
    return _check_steps(rec, w, run)


def trl_events(lines: Iterable[str]) -> list[dict]:
    """The `BENCH_EVENT {json}` lines of a `trl_child.py` run, parsed, in order."""
    return [json.loads(line[len(EVENT) :]) for line in lines if line.startswith(EVENT)]


def run_trl(
    w: Workload, model: Path, data: Path, run_dir: Path, venv: Path, repeat: int, seed: int
) -> RunRecord:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = json.dumps(dataclasses.asdict(w))
    cmd = [str(trl_python(venv)), str(HERE / "trl_child.py"), "--model", str(model), "--data", str(data),
           "--spec", spec, "--out", str(run_dir / "trainer"), "--seed", str(seed)]  # fmt: skip
    run = run_timed(cmd, base_env(), REPO, timeout_s=1800, log_path=run_dir / "output.log")
    rec = _record("trl", w, repeat, None, run, seed)
    events = trl_events(line for _, line in run.lines)
    begins = [e["time"] - run.launched_at for e in events if e["event"] == "step_begin"]
    rec.step_end_s = [e["time"] - run.launched_at for e in events if e["event"] == "step_end"]
    rec.startup_s = begins[0] if begins else float("nan")
    logs = [e["logs"] for e in events if e["event"] == "log" and "reward" in e["logs"]]
    rec.rewards = [float(lg["reward"]) for lg in logs]
    rec.response_lens = [float(lg.get("completions/mean_length", "nan")) for lg in logs]
    settings = [e["settings"] for e in events if e["event"] == "settings"]
    lrs = [float(lg.get("learning_rate", "nan")) for lg in logs]
    rec.settings = {**(settings[0] if settings else {}), "lr logged per step": lr_per_step_text(lrs)}
    return _check_steps(rec, w, run)


def _record(
    system: str, w: Workload, repeat: int, placement: str | None, run: TimedRun, seed: int
) -> RunRecord:
    wall = (run.lines[-1][0] - run.launched_at) if run.lines else 0.0
    return RunRecord(
        system=system, workload=w.name, repeat=repeat, seed=seed, placement=placement, returncode=run.returncode,
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
    p.add_argument(
        "--seed", type=int, default=1, help="seed of repeat 0; repeat r runs both systems with seed + r"
    )
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
    if a.seed < 0:
        p.error(f"--seed {a.seed}: must be >= 0")
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
                seed = a.seed + rep
                if system == "miles":
                    rec = run_miles(w, model, data, run_dir, placements[w.name], rep, seed)
                else:
                    rec = run_trl(w, model, data, run_dir, venv, rep, seed)
                records.append(rec)
                steps = step_intervals(rec.step_end_s, w.warmup_steps) if rec.ok else []
                print(
                    f"[vs_trl] {w.name} {system} #{rep} (seed {seed}): "
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
