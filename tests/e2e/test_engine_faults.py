"""Engine faults in the tiny colocated run (2 trainers, 2 embedded engines behind sglang-router).

An engine SIGKILLed or SIGSTOPped in the middle of rollout 1 (see `tests/e2e/faults.py`): with
--use-fault-tolerance the run completes, every step is logged, every prompt is trained exactly once, and the engine
was restarted and refit (its log shows a second start; the run goes on at logprob_diff <= 1e-5, which a restarted
engine holding the initial weights would not reach). Without it the run fails within the request deadline with a
message naming the phase and the engine.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow

NUM_ROLLOUT, BATCH, N = 3, 4, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("faults")
    model = build_tiny_model(root / "model", task="echo", seed=0)
    rows = make_rows("echo", 64, seed=0)
    for i, row in enumerate(rows):  # prompt texts repeat in the toy task: number the rows
        row["metadata"] = {"pid": i}
    data = write_jsonl(rows, root / "data.jsonl")
    return root, str(model), str(data), rows


def _args(model: str, data: str, run_dir: str, fault: str, extra: list[str] = ()) -> list[str]:
    return [
        "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math", "--num-rollout", str(NUM_ROLLOUT),
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "4",
        "--global-batch-size", str(BATCH * N), "--lr", "1e-3", "--actor-num-gpus-per-node", "2", "--colocate",
        "--run-dir", run_dir, "--dump-details", os.path.join(run_dir, "dump"),
        "--custom-generate-function-path", f"tests.e2e.faults:{fault}", *extra,
    ]  # fmt: skip


FT = ["--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "3",
      "--rollout-request-timeout", "120"]  # fmt: skip


def _check_completed(run_dir: str, rows: list[dict]) -> None:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == list(range(NUM_ROLLOUT))
    for m in metrics:  # the restarted engine was refit: engines and trainer agree on every step
        assert m["train/train_rollout_logprob_abs_diff"] <= 1e-5
    trained = []
    for r in range(NUM_ROLLOUT):
        with open(os.path.join(run_dir, "dump", f"rollout_{r:07d}.jsonl")) as f:
            samples = [json.loads(line) for line in f]
        assert len(samples) == BATCH * N
        assert all(s["status"] in ("completed", "truncated") for s in samples)  # none lost to the fault
        trained += [s["metadata"]["pid"] for s in samples[::N]]
        for g in range(BATCH):  # a group is N samples of one prompt
            assert len({s["metadata"]["pid"] for s in samples[g * N : (g + 1) * N]}) == 1
    # every prompt of the run, in order, exactly once (no shuffle: rollout r takes rows r*BATCH ...)
    assert trained == list(range(NUM_ROLLOUT * BATCH))
    with open(os.path.join(run_dir, "logs", "engine_0.log")) as f:
        log0 = f.read()
    with open(os.path.join(run_dir, "logs", "engine_1.log")) as f:
        log1 = f.read()
    marker = "embedded engine serving"  # engine 0 was started twice: at launch and by the health monitor
    assert (log0.count(marker), log1.count(marker)) == (2, 1), (log0[-2000:], log1[-2000:])


@pytest.mark.parametrize("fault", ["sigkill_engine", "sigstop_engine"])
def test_fault_tolerance_survives_engine_fault(tiny, fault, capfd):
    from miles.train import main

    root, model, data, rows = tiny
    run_dir = str(root / f"run_ft_{fault}")
    assert main(_args(model, data, run_dir, fault, FT)) == 0
    out = capfd.readouterr()
    assert "fault injection:" in out.out + out.err
    _check_completed(run_dir, rows)


# the faults hit the engine's own process: keep it one (a colocated CPU run otherwise serves its engines from the
# training ranks' processes, and --use-fault-tolerance keeps them separate by itself)
NO_FT = ["--rollout-request-timeout", "20", "--no-cpu-engine-in-trainer"]


@pytest.mark.own_ray  # the fault log's path reaches the Ray workers by environment: they must start after it is set
@pytest.mark.parametrize("fault", ["sigkill_engine", "sigstop_engine"])
def test_without_fault_tolerance_the_fault_is_named(tiny, fault, monkeypatch):
    """Without --use-fault-tolerance the run ends within the request deadline with an error naming the engine
    and the phase. A stopped engine fails the rollout's requests; a killed one refuses connections, so the
    generate client sends its requests to the other engine and the run ends at the next engine control call
    (the colocated memory release before training, which first waits for the engines to be idle), which names
    the engine and the endpoint."""
    import time

    from miles.train import main
    from tests.e2e.faults import FAULT_LOG_ENV

    root, model, data, _ = tiny
    run_dir = str(root / f"run_noft_{fault}")
    fault_log = root / f"{fault}.log"
    monkeypatch.setenv(FAULT_LOG_ENV, str(fault_log))  # inherited by the Ray workers started in main()
    with pytest.raises(Exception) as info:
        main(_args(model, data, run_dir, fault, NO_FT))
    failed_at = time.time()
    message = str(info.value)
    assert fault_log.exists(), message[-3000:]
    url = fault_log.read_text().split(" to engine ")[1].split()[0]
    assert url in message, message[-3000:]
    phases = (
        "rollout generate (rollout1)",
        "engine control, phase request: cannot reach the engine",
        # the release before training first waits for the engines to be idle (/flush_cache)
        "engine control: idle before a release, phase request: cannot reach the engine",
    )
    assert any(phase in message for phase in phases), message[-3000:]
    assert failed_at - fault_log.stat().st_mtime < 20 + 60, message[-3000:]
    if fault == "sigstop_engine":  # a request deadline: every miles process dumped its stacks first
        folder = message.split("Python stacks of every miles process: ")[1].split("]")[0]
        assert folder.startswith(os.path.join(run_dir, "logs", "hang-")), message[-3000:]
        index = open(os.path.join(folder, "index.txt")).read()
        port = url.rsplit(":", 1)[1]
        assert f"engine-server-port{port} pid" in index and "no dump within" in index, index  # stopped
        files = os.listdir(folder)
        for role in ("driver", "rollout-manager", "engine-fleet", "trainer-actor-rank0"):
            assert any(f.startswith(f"{role}-pid") for f in files), (role, files)
