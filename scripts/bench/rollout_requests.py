"""Rollout request overhead (issue 10 item 3): the rollout runner against one real embedded engine, no Ray.

    python scripts/bench/rollout_requests.py [--rollouts 6] [--max-response-len 2]

Builds the quick-start model (`miles.tools.tiny_model`, echo task) and 16 prompts x 8 samples per rollout, starts
one embedded engine process, and times `RolloutRunner.generate` with a prompt group per batch request (the
default) and with one request per sample (batching switched off by making every group's key None). Prints the
median seconds per rollout (first rollout left out), the /generate requests per rollout and the ratio.
Run it alone: `flock /tmp/miles-heavy.lock python scripts/bench/rollout_requests.py` on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=6)
    p.add_argument("--max-response-len", type=int, default=2)
    a = p.parse_args(argv)
    if a.rollouts < 2:
        p.error(f"--rollouts {a.rollouts}: must be >= 2 (the first is warm-up)")

    from transformers import AutoTokenizer

    import miles.rollout.default_rollout as default_rollout
    from miles.config import parse_config
    from miles.engines.sglang_engine import EngineProcess
    from miles.rollout.runner import RolloutRunner
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-requests-"))
    model = build_tiny_model(work / "model", task="echo", seed=0, overwrite=True)
    data = write_jsonl(make_rows("echo", 2000, seed=0, fmt="chat"), work / "echo.jsonl")
    cfg = parse_config(
        f"--hf-checkpoint {model} --prompt-data {data} --input-key prompt --label-key label --apply-chat-template "
        f"--rm-type math --num-rollout {a.rollouts} --rollout-batch-size 16 --n-samples-per-prompt 8 "
        f"--rollout-max-response-len {a.max_response_len} --rollout-temperature 1.0 --global-batch-size 128 "
        "--colocate".split()
    )
    tok = AutoTokenizer.from_pretrained(str(model))
    results = {}
    with EngineProcess(str(model), kind="local", local_args={"num-threads": 1}, startup_timeout=300) as eng:
        for mode in ("batched", "per-sample", "batched"):  # A/B/A
            runner = RolloutRunner(
                cfg.data, cfg.rollout, cfg.eval, tok, eng.url, [eng.url], None, concurrency=128
            )
            original = default_rollout.batching
            if mode == "per-sample":
                default_rollout.batching = lambda key: contextlib.nullcontext()
            try:
                times = []
                for rollout_id in range(a.rollouts):
                    t0 = time.perf_counter()
                    runner.generate(rollout_id)
                    times.append(time.perf_counter() - t0)
                requests = runner.generate_requests_sent / a.rollouts
            finally:
                default_rollout.batching = original
                runner.close()
            results.setdefault(mode, []).append((statistics.median(times[1:]), requests))
            print(f"[rollout_requests] {mode}: {statistics.median(times[1:]):.3f} s/rollout "
                  f"[{min(times[1:]):.3f}-{max(times[1:]):.3f}], {requests:.0f} requests/rollout", flush=True)  # fmt: skip
    batched = statistics.median(s for s, _ in results["batched"])
    single = results["per-sample"][0][0]
    print(f"[rollout_requests] per-sample / batched seconds per rollout: {single / batched:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
