"""Pictures of runs from their `metrics.jsonl`: the `report.png` every run leaves in its run directory, and
overlays of several runs.

    python -m miles.tools.plot RUN_DIR [RUN_DIR ...] [--out FILE] [--smooth N]

Six panels against the rollout id: reward (train and eval sets), response length, loss, KL and the
train/rollout log-prob difference (log scale), the time split of each step, and throughput. One run: one color per
series, time as stacked bars. Several runs: one color per run. The series of a panel differ by line style.
Uses matplotlib's Agg canvas directly (no pyplot, no display, no global backend switch).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles.tools._cli import console_script, run_tool
from miles.utils.tracking import METRICS_FILE, read_metrics, record_step
from miles.utils.types import JSON

if TYPE_CHECKING:
    from matplotlib.axes import Axes

REPORT_FILE = "report.png"
TIME_PHASES = ("rollout", "train", "refit", "save", "save_hf", "eval")
_STYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Series:
    key: str  # metric name; a trailing "*" matches every metric with that prefix (e.g. "eval/*")
    label: str
    absolute: bool = False  # plot |value| (for log scales of signed quantities)


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    log_y: bool = False


PANELS = (
    Panel("reward", (Series("rollout/raw_reward", "train"), Series("eval/*", "eval"))),
    Panel("response length (tokens)", (Series("rollout/response_len", "mean"),)),
    Panel("loss", (Series("train/loss", "loss"), Series("train/pg_loss", "pg loss"))),
    Panel(
        "KL and log-prob mismatch (log)",
        (
            Series("train/ppo_kl", "|ppo_kl|", absolute=True),
            Series("train/kl_loss", "kl loss", absolute=True),
            Series("train/train_rollout_logprob_abs_diff", "|train - rollout| log-prob"),
        ),
        log_y=True,
    ),
    Panel(
        "throughput (tokens/s, log)",
        (Series("perf/generated_tokens_per_s", "generated"), Series("perf/trained_tokens_per_s", "trained")),
        log_y=True,
    ),
)


@dataclass
class Run:
    name: str
    rows: list[dict[str, JSON]]  # one per step, sorted, the last record of a step kept

    def steps(self) -> list[int]:
        return [record_step(r) for r in self.rows]

    def keys(self, pattern: str) -> list[str]:
        if not pattern.endswith("*"):
            return [pattern] if any(pattern in r for r in self.rows) else []
        prefix = pattern[:-1]
        return sorted({k for r in self.rows for k in r if k.startswith(prefix)})

    def values(self, key: str, absolute: bool = False) -> list[float]:
        out = []
        for r in self.rows:
            value = r.get(key, math.nan)
            try:
                v = float(value) if isinstance(value, int | float | str) else math.nan
            except ValueError:
                v = math.nan
            out.append(abs(v) if absolute else v)
        return out


def load_run(run_dir: str | os.PathLike) -> Run:
    """The metrics of `run_dir` (or of a metrics.jsonl path), one row per step."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {METRICS_FILE} (expected a run directory written by miles.train)")
    by_step = {record_step(r): r for r in read_metrics(path) if "step" in r}
    name = path.parent.name
    return Run(name, [by_step[s] for s in sorted(by_step)])


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` finite values (NaN stays NaN)."""
    out: list[float] = []
    recent: list[float] = []
    for v in values:
        if math.isnan(v):
            out.append(math.nan)
            continue
        recent = (recent + [v])[-window:]
        out.append(sum(recent) / len(recent))
    return out


def _auto_window(n: int) -> int:
    return max(1, min(20, n // 10))


def _draw_series(ax: Axes, runs: list[Run], panel: Panel, window: int) -> bool:
    many = len(runs) > 1
    drawn = False
    for run_index, run in enumerate(runs):
        x = run.steps()
        k = 0
        for series in panel.series:
            for key in run.keys(series.key):
                points = [
                    (s, v)
                    for s, v in zip(x, run.values(key, series.absolute))
                    if not math.isnan(v) and (v > 0 or not panel.log_y)
                ]
                if not points:
                    continue
                px, py = [p[0] for p in points], [p[1] for p in points]
                label = series.label if not series.key.endswith("*") else key
                color = f"C{run_index}" if many else f"C{k}"
                style = _STYLES[k % len(_STYLES)]  # equal series (loss == pg loss) stay visible
                name = f"{run.name}: {label}" if many else label
                sparse = len(points) < max(15, len(x) // 3)  # e.g. eval every N rollouts: mark the points
                if window > 1 and not sparse:
                    ax.plot(px, py, color=color, linestyle=style, alpha=0.25, linewidth=0.8)
                    ax.plot(px, smooth(py, window), color=color, linestyle=style, linewidth=1.8, label=name)
                else:
                    ax.plot(
                        px,
                        py,
                        color=color,
                        linestyle=style,
                        linewidth=1.6,
                        marker="o",
                        markersize=3,
                        label=name,
                    )
                k += 1
                drawn = True
    if panel.log_y and drawn:
        ax.set_yscale("log")
    return drawn


def _draw_time(ax: Axes, runs: list[Run]) -> bool:
    drawn = False
    if len(runs) == 1:
        run = runs[0]
        x = run.steps()
        stacks = {}
        for phase in TIME_PHASES:
            y = [0.0 if math.isnan(v) else v for v in run.values(f"timing/{phase}")]
            if any(y):
                stacks[phase] = y
        if len(x) > 120:  # too many bars to see: stacked areas
            ax.stackplot(
                x, *stacks.values(), labels=list(stacks), colors=[f"C{i}" for i in range(len(stacks))]
            )
            return bool(stacks)
        bottom = [0.0] * len(x)
        for i, (phase, y) in enumerate(stacks.items()):
            ax.bar(x, y, bottom=bottom, width=0.85, color=f"C{i}", label=phase, linewidth=0)
            bottom = [b + v for b, v in zip(bottom, y)]
        return bool(stacks)
    for run_index, run in enumerate(runs):
        for k, phase in enumerate(("rollout", "train", "refit")):
            y = run.values(f"timing/{phase}")
            if all(math.isnan(v) for v in y):
                continue
            ax.plot(run.steps(), y, color=f"C{run_index}", linestyle=_STYLES[k], label=f"{run.name}: {phase}")
            drawn = True
    return drawn


def plot_runs(
    runs: list[Run], out: str | os.PathLike, window: int | None = None, title: str | None = None
) -> Path:
    """Draw the panels for `runs` into PNG `out` (written to a temp file, then renamed); returns `out`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not runs or not any(r.rows for r in runs):
        raise ValueError("no metrics to plot")
    n = max(len(r.rows) for r in runs)
    window = _auto_window(n) if window is None else max(1, window)
    fig = Figure(figsize=(16, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    panels = list(PANELS[:4]) + [None] + [PANELS[4]]  # the time split sits bottom-middle
    for ax, panel in zip(axes.flat, panels):
        if panel is None:
            drawn = _draw_time(ax, runs)
            ax.set_title("time per rollout (s)")
        else:
            drawn = _draw_series(ax, runs, panel, window)
            ax.set_title(panel.title)
        ax.set_xlabel("rollout")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    if title is None:
        title = _title(runs, window)
    fig.suptitle(title, fontsize=13)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def _title(runs: list[Run], window: int) -> str:
    parts = []
    for run in runs:
        rewards = [v for v in run.values("rollout/raw_reward") if not math.isnan(v)]
        last = f", last reward {rewards[-1]:.3f}" if rewards else ""
        parts.append(f"{run.name} ({len(run.rows)} rollouts{last})")
    note = f"  [thick lines: mean of the last {window}]" if window > 1 else ""
    return "; ".join(parts) + note


def write_report(run_dir: str | os.PathLike) -> Path | None:
    """`<run_dir>/report.png` from the run's metrics; None when the run logged no step yet."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return None
    run = load_run(run_dir)
    if not run.rows:
        return None
    return plot_runs([run], Path(run_dir) / REPORT_FILE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m miles.tools.plot", description="Plot (and overlay) the metrics of miles runs."
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    p.add_argument(
        "--out", default=None, help="output PNG; default: RUN_DIR/report.png for one run, else runs.png"
    )
    p.add_argument(
        "--smooth", type=int, default=None, help="trailing-mean window; default: about 1/10 of the run"
    )
    args = p.parse_args(argv)

    def work() -> Path:
        runs = [load_run(d) for d in args.run_dirs]
        names = [r.name for r in runs]
        if len(set(names)) != len(names):  # same directory names under different parents: use the paths
            for r, d in zip(runs, args.run_dirs):
                r.name = str(d)
        default = Path(args.run_dirs[0]) / REPORT_FILE if len(runs) == 1 else Path("runs.png")
        return plot_runs(runs, args.out or default, window=args.smooth)

    return run_tool("plot", work)


def cli() -> None:
    """The console script."""
    console_script(main)


if __name__ == "__main__":
    cli()
