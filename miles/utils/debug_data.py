"""Saved rollouts for replay debugging (`--save-debug-rollout-data`, `--load-debug-rollout-data`).

One file per rollout, JSON lines: a header `{"rollout_id": N, "metrics": {...}}`, then one `Sample.to_dict()` per
sample, in the order the trainer received them. JSON keeps every Python float exactly (`repr` round-trips), so a
replayed rollout trains on bit-identical inputs. Files are written atomically (temp file + rename). No pickle: a
debug file from elsewhere cannot run code.

PATH is a template with `{rollout_id}` (e.g. `dbg/rollout_{rollout_id}.jsonl`), or a directory that gets
`rollout_<id:07d>.jsonl` files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from miles.utils.types import Sample

FORMAT = "miles-debug-rollout/1"


def rollout_path(path: str, rollout_id: int) -> Path:
    """The file of rollout `rollout_id` under PATH (a `{rollout_id}` template, or a directory)."""
    if "{rollout_id" in path:
        return Path(path.format(rollout_id=rollout_id))
    return Path(path) / f"rollout_{rollout_id:07d}.jsonl"


def save_rollout(
    path: str, rollout_id: int, samples: list[Sample], metrics: dict[str, float], flag: str
) -> Path:
    """Write rollout `rollout_id` atomically; ValueError naming `flag` when a sample does not serialise."""
    final = rollout_path(path, rollout_id)
    final.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "rollout_id": rollout_id, "num_samples": len(samples), "metrics": metrics}
    lines = [json.dumps(header, allow_nan=True)]
    for s in samples:
        try:
            lines.append(json.dumps(s.to_dict(), allow_nan=True))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{flag}={path!r}: sample {s.index} of rollout {rollout_id} is not JSON: {e}"
            ) from e
    tmp = final.with_name(final.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(f"{flag}={path!r}: cannot write {final}: {e}") from e
    return final


def load_rollout(path: str, rollout_id: int, flag: str) -> tuple[list[Sample], dict[str, float]]:
    """Read rollout `rollout_id` back: (samples, the rollout metrics logged when it was generated)."""
    file = rollout_path(path, rollout_id)
    if not file.is_file():
        raise ValueError(f"{flag}={path!r}: {file} does not exist (no saved rollout {rollout_id})")
    with open(file, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    try:
        header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {file}:1: not a debug rollout header: {e}") from e
    if header.get("format") != FORMAT or header.get("rollout_id") != rollout_id:
        raise ValueError(
            f"{flag}: {file}:1: expected a {FORMAT} header of rollout {rollout_id}, got {str(header)[:120]}"
        )
    samples = []
    for lineno, line in enumerate(lines[1:], start=2):
        try:
            samples.append(Sample.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{flag}: {file}:{lineno}: not a sample: {e}") from e
    if len(samples) != header.get("num_samples"):
        raise ValueError(
            f"{flag}: {file}: header says {header.get('num_samples')} samples, found {len(samples)} (truncated?)"
        )
    return samples, {k: float(v) for k, v in (header.get("metrics") or {}).items()}


def missing_rollouts(path: str, rollout_ids: range) -> list[Path]:
    """The files of `rollout_ids` that do not exist (for the pre-flight check)."""
    return [p for p in (rollout_path(path, i) for i in rollout_ids) if not p.is_file()]
