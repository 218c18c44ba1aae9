"""End to end on CPU with engines miles does not launch, and with generation through sglang-router.

Two embedded engines are started by the test as separate processes (`python -m miles.engines.local`). A tiny
disaggregated GRPO run uses them through `--rollout-external-engine-addrs`: it trains, refits them (each reports
the last weight version, and the trainer's log-probs match the engines' at every step, which engines holding the
initial weights would not), and leaves them running at exit. A second tiny run, with `--router-policy
round_robin`, sends its generation through the router (whose pass-through `--router-log-level info` log shows
every /generate), against the same engines; a run without a router policy sends none there. A third uses a
router the test started (`--sglang-router-ip/--sglang-router-port`): generation goes through it, and at exit
miles has unregistered its engines from it and left it running.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

pytestmark = pytest.mark.slow

NUM_ROLLOUT, BATCH, N = 2, 4, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from miles.engines.sglang_engine import EngineProcess
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl

    root = tmp_path_factory.mktemp("external")
    model = str(build_tiny_model(root / "model", task="echo", seed=0))
    data = str(write_jsonl(make_rows("echo", 64, seed=0), root / "data.jsonl"))
    engines = [
        EngineProcess(
            model,
            kind="local",
            local_args={"num-threads": 1, "random-seed": i, "max-running-requests": 64},
            log_path=str(root / f"engine_{i}.log"),
            startup_timeout=300,
        )
        for i in range(2)
    ]
    try:
        for e in engines:
            e.launch()
        yield root, model, data, engines
    finally:
        for e in engines:
            e.shutdown()


def _args(model: str, data: str, run_dir: str, engines: list, extra: list[str] = ()) -> list[str]:
    addrs = [e.url.removeprefix("http://") for e in engines]
    return [
        "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math", "--num-rollout", str(NUM_ROLLOUT),
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "4",
        "--global-batch-size", str(BATCH * N), "--lr", "1e-3", "--actor-num-gpus-per-node", "2",
        "--rollout-external-engine-addrs", *addrs, "--run-dir", run_dir,
        "--update-weight-buffer-size", "20000", *extra,
    ]  # fmt: skip


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _check_trained_and_refit(run_dir: str, engines: list) -> None:
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(NUM_ROLLOUT))
    for m in metrics:
        assert m["train/train_rollout_logprob_abs_diff"] <= 1e-5  # the engines ran the trainer's weights
        assert m["rollout/raw_reward"] >= 0.0
    for e in engines:
        assert e.proc.poll() is None, f"external engine {e.url} was stopped by the run"
        assert httpx.get(e.url + "/health", timeout=10).status_code == 200
        # the last refit (after rollout NUM_ROLLOUT - 1) set weight version NUM_ROLLOUT on every engine
        assert httpx.get(e.url + "/model_info", timeout=10).json()["weight_version"] == str(NUM_ROLLOUT)


def _router_generates(path: str) -> int:
    """/generate requests in an sglang-router log written at --log-level info."""
    if not os.path.exists(path):
        return 0
    with open(path, errors="replace") as f:
        text = re.sub(r"\x1b\[[0-9;]*m", "", f.read())
    return len(re.findall(r"uri=/generate\b.*started processing request", text))


def test_external_engines_are_trained_refit_and_left_running(setup):
    from miles.train import main

    root, model, data, engines = setup
    run_dir = str(root / "run_direct")
    assert main(_args(model, data, run_dir, engines, extra=["--router-log-level", "info"])) == 0
    _check_trained_and_refit(run_dir, engines)
    assert (
        _router_generates(os.path.join(run_dir, "logs", "router.log")) == 0
    )  # no router policy: generation went straight to the engines


def test_router_policy_sends_generation_through_the_router(setup):
    from miles.train import main

    root, model, data, engines = setup
    run_dir = str(root / "run_router")
    extra = ["--router-policy", "round_robin", "--router-log-level", "info"]
    assert main(_args(model, data, run_dir, engines, extra=extra)) == 0
    _check_trained_and_refit(run_dir, engines)
    router_log = os.path.join(run_dir, "logs", "router.log")
    assert _router_generates(router_log) >= NUM_ROLLOUT * BATCH * N  # one request per sample, none batched


def test_a_running_router_is_used_and_left_running(setup):
    from miles.engines.router import Router
    from miles.train import main

    root, model, data, engines = setup
    log = str(root / "own_router.log")
    with Router([], extra_args=["--log-level", "info"], log_path=log) as router:
        run_dir = str(root / "run_running_router")
        extra = ["--sglang-router-ip", router.host, "--sglang-router-port", str(router.port)]
        assert main(_args(model, data, run_dir, engines, extra=extra)) == 0
        _check_trained_and_refit(run_dir, engines)
        assert router.proc is not None and router.proc.poll() is None  # miles did not stop it
        assert router.list_workers() == []  # the engines miles registered are unregistered at exit
        assert _router_generates(log) >= NUM_ROLLOUT * BATCH * N
        assert not os.path.exists(os.path.join(run_dir, "logs", "router.log"))  # miles launched no router


def test_fault_tolerance_names_a_dead_external_engine_and_does_not_restart_it(setup):
    """Last in the module: it kills the first engine (SIGKILL in the middle of rollout 1, see tests/e2e/faults.py).
    The health monitor takes it out of the router and, instead of restarting it, fails the run naming it as
    external."""
    from miles.train import main

    root, model, data, engines = setup
    run_dir = str(root / "run_ft")
    extra = [
        "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "3",
        "--custom-generate-function-path", "tests.e2e.faults:sigkill_engine",
    ]  # fmt: skip
    with pytest.raises(Exception) as info:
        main(_args(model, data, run_dir, engines, extra=extra))
    message = str(info.value)
    assert f"engine restart: {engines[0].url} could not be restarted" in message, message[-3000:]
    assert "is external (--rollout-external-engine-addrs)" in message, message[-3000:]
    assert engines[0].proc.poll() is not None  # the injected fault killed it; nothing started it again:
    with pytest.raises(httpx.HTTPError):
        httpx.get(engines[0].url + "/health", timeout=5)
    assert engines[1].proc.poll() is None
