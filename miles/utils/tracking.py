"""Metrics sinks: one JSON line per step in `<run_dir>/metrics.jsonl`, optionally Weights & Biases."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


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
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
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
                mode=wandb_mode,
                dir=str(self.run_dir),
                config=config,
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
