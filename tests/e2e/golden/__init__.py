"""Golden metrics of the README's tiny run (scripts/run-tiny-cpu.sh, fixed seeds, CPU): the first rollouts' metrics
lines, so a change that moves the numbers is caught by a test instead of by eye.

Check a run by hand (about a minute), e.g. before and after a refactor that must not change numbers::

    NUM_ROLLOUT=5 MILES_SKIP_INSTALL=1 RUN_DIR=/tmp/tiny bash scripts/run-tiny-cpu.sh
    python -m tests.e2e.golden /tmp/tiny/metrics.jsonl            # compare
    python -m tests.e2e.golden /tmp/tiny/metrics.jsonl --update   # a change that should move them: rewrite

Compared: every key but wall-clock and memory ones (`timing/`, `perf/`), within a relative 1e-5 (losses, norms:
fp32 kernels of another CPU may round differently) and an absolute 1e-7. Rewards are means over 128 samples, so
one different token moves them by 1/128: far outside the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

GOLDEN = Path(__file__).with_name("tiny_run.json")
ROLLOUTS = 5
VOLATILE = ("timing/", "perf/")


def _stable(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def read_rows(metrics_jsonl: str | Path) -> list[dict[str, float]]:
    with open(metrics_jsonl) as f:
        return [_stable(json.loads(line)) for line in f][:ROLLOUTS]


def differences(rows: list[dict[str, float]]) -> list[str]:
    """Each golden value the rows miss or contradict, as `rollout N key: got X, golden Y`."""
    golden = json.loads(GOLDEN.read_text())
    if len(rows) < len(golden):
        return [f"{len(rows)} rollouts, golden has {len(golden)}"]
    out = []
    for i, (got, want) in enumerate(zip(rows, golden)):
        for key, value in want.items():
            have = got.get(key)
            if have is None or abs(have - value) > 1e-7 + 1e-5 * abs(value):
                out.append(f"rollout {i} {key}: got {have}, golden {value}")
    return out


def main(argv: list[str]) -> int:
    rows = read_rows(argv[0])
    if "--update" in argv[1:]:
        GOLDEN.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
        return 0
    diff = differences(rows)
    print("\n".join(diff) if diff else f"{len(rows)} rollouts equal the golden metrics")
    return 1 if diff else 0
