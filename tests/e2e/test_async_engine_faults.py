"""--use-fault-tolerance with --fully-async (issue 25 item 5): 1 trainer + 2 embedded engines disaggregated, an
engine SIGKILLed at the start of the second refit, while the engines are paused (the driver's refit is wrapped
here, in the driver's process). The refit fails on the dead engine, the health monitor restarts it, it is
refitted to the new version and readmitted before generation continues; its requests went to the other engine.
The run finishes, every trained sample is within --max-weight-staleness, no prompt is trained twice, none is
lost (the prompts not trained are those still in flight or buffered at the end), and engine 0 started twice."""

from __future__ import annotations

import json
import os
import signal

import pytest

pytestmark = pytest.mark.slow

STEPS, BATCH, N, BOUND = 4, 2, 2, 1


def test_fully_async_survives_an_engine_sigkill_mid_refit(tmp_path, monkeypatch):
    from miles.ray.colocate import MemoryChoreography
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl
    from miles.train_async import main
    from tests.e2e.faults import engine_pid

    model = build_tiny_model(tmp_path / "model", task="echo", seed=0)
    rows = make_rows("echo", 64, seed=0)
    for i, row in enumerate(rows):  # prompt texts repeat in the toy task: number the rows
        row["metadata"] = {"pid": i}
    data = write_jsonl(rows, tmp_path / "data.jsonl")
    run_dir = str(tmp_path / "run")
    killed: list[int] = []
    refit = MemoryChoreography.refit

    def refit_killing_engine_0(self, weight_version: str, flush_cache: bool = True):
        if weight_version == "2" and not killed:  # the engines are paused: the refit meets a dead engine
            killed.append(engine_pid(self.engine_urls[0]))
            os.kill(killed[0], signal.SIGKILL)
        return refit(self, weight_version, flush_cache)

    monkeypatch.setattr(MemoryChoreography, "refit", refit_killing_engine_0)
    argv = [
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
        "--custom-rm-path", "tests.integration.custom_fns:first_token_even", "--num-rollout", str(STEPS),
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "3",
        "--global-batch-size", str(BATCH * N), "--lr", "1e-3", "--seed", "1",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--fully-async",
        "--max-weight-staleness", str(BOUND), "--async-unused-samples-handler", "retry",
        "--pause-generation-mode", "retract", "--use-fault-tolerance", "--rollout-health-check-interval", "1",
        "--rollout-health-check-timeout", "3", "--rollout-request-timeout", "120",
        "--run-dir", run_dir, "--dump-details", os.path.join(run_dir, "dump"),
    ]  # fmt: skip
    assert main(argv) == 0
    assert killed, "the fault was never injected"

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert sum(m.get("async/engine_restarts", 0) for m in metrics) == 1
    assert all(m["async/dropped_groups"] == 0 for m in metrics)
    trained: list[int] = []
    for step in range(STEPS):
        with open(os.path.join(run_dir, "dump", f"rollout_{step:07d}.jsonl")) as f:
            samples = [json.loads(line) for line in f]
        assert len(samples) == BATCH * N
        assert all(s["status"] in ("completed", "truncated") for s in samples)
        assert all(0 <= s["metadata"]["weight_staleness"] <= BOUND for s in samples)
        for g in range(BATCH):  # a group is N samples of one prompt
            assert len({s["metadata"]["pid"] for s in samples[g * N : (g + 1) * N]}) == 1
        trained += [s["metadata"]["pid"] for s in samples[::N]]
    assert len(trained) == len(set(trained)), trained  # no prompt trained twice
    # prompts are admitted in order: one not trained below the highest trained was in flight or buffered at the end
    missing = set(range(max(trained))) - set(trained)
    last = metrics[-1]  # (a count of 0 is not logged)
    at_end = last.get("async/in_flight_groups", 0) + last.get("async/buffered_groups", 0)
    assert len(missing) <= at_end, (trained, last)
    with open(os.path.join(run_dir, "logs", "engine_0.log")) as f:
        log0 = f.read()
    with open(os.path.join(run_dir, "logs", "engine_1.log")) as f:
        log1 = f.read()
    marker = "embedded engine serving"  # engine 0 was started twice: at launch and by the health monitor
    assert (log0.count(marker), log1.count(marker)) == (2, 1), (log0[-2000:], log1[-2000:])
