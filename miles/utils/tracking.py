"""Metrics sinks: one JSON line per step in `<run_dir>/metrics.jsonl`, optionally Weights & Biases and TensorBoard.

Every sink gets the same scalar names (`rollout/raw_reward`, `train/loss`, `timing/train`, `perf/...`), so a run
reads the same in wandb, TensorBoard and the plots of `miles.tools.plot`.

Resuming (`--load`): `resume_at(step)` drops the lines at or after `step` from metrics.jsonl (rewritten atomically)
and tells TensorBoard to purge its events from `step` on, so a step that ran before a crash and runs again after
the resume appears once.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from miles.utils.types import JSON

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _plain(v: object) -> object:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _scalar(v: object) -> float | None:
    """A value TensorBoard can plot (numbers, incl. the "nan"/"inf" strings metrics.jsonl uses), else None."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def read_metrics(path: str | os.PathLike) -> list[dict[str, JSON]]:
    """The records of a metrics.jsonl file (a truncated last line, from a crash mid-write, is skipped)."""
    records: list[dict[str, JSON]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s: skipping an unreadable line: %.80s", path, line)
    return records


def record_step(record: dict[str, JSON]) -> int:
    """The `step` of a metrics record; ValueError when it is missing or not a number."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int | float | str):
        raise ValueError(f"metrics record without a numeric step: {str(record)[:80]}")
    return int(step)


class Tracker:
    """Writes metrics. Each `log` call appends one line and flushes, so a crash loses nothing already logged."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        use_wandb: bool = False,
        wandb_project: str | None = None,
        wandb_group: str | None = None,
        wandb_key: str | None = None,
        wandb_mode: str | None = None,
        config: Mapping[str, object] | None = None,  # the run's Config.to_dict(), as wandb.init takes it
        use_tensorboard: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._use_tensorboard = use_tensorboard
        self._tb = None  # created on resume_at or the first log, so that a resume can purge later events
        self._purge_step: int | None = None
        if use_tensorboard:
            try:
                import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
            except ImportError as e:
                raise ImportError(
                    "--use-tensorboard needs the `tensorboard` package: pip install tensorboard"
                ) from e
        self._wandb = None
        if use_wandb:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("--use-wandb needs the `wandb` package: pip install wandb") from e
            if wandb_key:
                os.environ.setdefault("WANDB_API_KEY", wandb_key)
            self._wandb = wandb.init(
                project=wandb_project,
                group=wandb_group,
                mode=cast(
                    "Literal['online', 'offline', 'disabled'] | None", wandb_mode
                ),  # --wandb-mode choices
                dir=str(self.run_dir),
                config=None if config is None else dict(config),
            )

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / TENSORBOARD_DIR

    def resume_at(self, step: int) -> None:
        """The run continues at `step`: drop records of steps >= `step` (they will be logged again)."""
        self._file.close()
        records = read_metrics(self.metrics_path)
        kept = [r for r in records if (record_step(r) if "step" in r else -1) < step]
        dropped = len(records) - len(kept)
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_path)
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        if dropped:
            logger.info(
                "resuming at step %d: dropped %d later line(s) of %s", step, dropped, self.metrics_path
            )
        self._purge_step = step if step > 0 else None

    def _tensorboard(self) -> SummaryWriter:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=self._purge_step)
        return self._tb

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if self._use_tensorboard:
            tb = self._tensorboard()
            for key, value in record.items():
                scalar = _scalar(value)
                if key != "step" and scalar is not None:
                    tb.add_scalar(key, scalar, global_step=step)
            tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
