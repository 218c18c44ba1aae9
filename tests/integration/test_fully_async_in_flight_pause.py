"""--fully-async (issue 25) with requests in flight across every pause: the rollout manager's generation worker
against a real embedded engine (no Ray, no trainer; the refit is a disk update to the next weight version).

The model's EOS is made unreachable (`schedule_eos` "never"), so every response runs to the length limit and the
groups the worker admits after a batch is taken are still generating when the pause comes (the test waits until
the engine reports running requests; one batch in flight at a time, the default, so each batch starts when the
one before finishes and runs while that one is taken). Per pause mode: trained samples span two weight versions, abort pauses
return requests that the worker continues (`async/continued_samples` > 0) while retract and in_place keep them in
the engine (0), and every sample is within --max-weight-staleness.
"""

from __future__ import annotations

import time

import pytest

from miles.config import parse_config

STEPS, BOUND, MAX_LEN = 3, 1, 48
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model
    from miles.tools.toy_data import make_rows, write_jsonl
    from scripts.bench.bench_workloads import schedule_eos

    root = tmp_path_factory.mktemp("inflight")
    model = build_tiny_model(
        root / "model",
        task="echo",
        seed=0,
        tie_word_embeddings=False,
        edit_model=lambda m, tok: schedule_eos(m, tok.eos_token_id, [], [], "never"),
    )
    data = write_jsonl(make_rows("echo", 64, seed=0), root / "data.jsonl")
    return str(model), str(data)


@pytest.fixture(scope="module")
def engine(tiny):
    from miles.engines.sglang_engine import EngineProcess

    with EngineProcess(tiny[0], kind="local", local_args={"num-threads": 1}, startup_timeout=120) as eng:
        yield eng


def _manager(tiny, mode: str):
    from miles.ray.rollout_manager import RolloutManager

    model, data = tiny
    cfg = parse_config(
        (
            f"--hf-checkpoint {model} --prompt-data {data} --input-key prompt --label-key label "
            "--custom-rm-path tests.integration.custom_fns:first_token_even --rollout-batch-size 2 "
            f"--n-samples-per-prompt 2 --rollout-max-response-len {MAX_LEN} --global-batch-size 4 "
            f"--num-rollout {STEPS} --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --fully-async "
            f"--max-weight-staleness {BOUND} --pause-generation-mode {mode}"
        ).split()
    )
    return RolloutManager(cfg)


def _running(url: str) -> int:
    """Requests the engine holds: running, or waiting (a retract pause moves running ones back to the queue)."""
    from miles.utils.engine_control_http import request

    (load,) = request("GET", url, "get_load", "test", 10, {}).json()
    return int(load["num_running"]) + int(load["num_waiting"])


def _set_version(url: str, model: str, version: str, flush: bool) -> None:
    from miles.utils.engine_control_http import post_engine

    body = {"model_path": model, "weight_version": version, "flush_cache": flush}
    post_engine(url, "update_weights_from_disk", body, {}, 60, "test refit")


def _wait_for_running(url: str) -> None:
    deadline = time.monotonic() + 30
    while not _running(url):  # the next groups are generating
        assert time.monotonic() < deadline, "no request running"
        time.sleep(0.01)


def _train(manager, url: str, model: str, mode: str, steps: range, refit_last: bool = False):
    """Take a batch per step; between steps (and after the last one with `refit_last`), once requests run:
    pause, refit to the next version, continue. Returns the trained samples, each step's metrics and the
    number of requests the engine held while paused."""
    trained, rows, held = [], [], []
    for step in steps:
        samples, metrics = manager.take_batch(step)
        trained += samples
        rows.append(metrics)
        if step + 1 == steps.stop and not refit_last:
            break
        _wait_for_running(url)
        manager.pause_generation(mode)
        held.append(_running(url))  # in_place/retract keep them; abort returned them
        _set_version(url, model, str(step + 1), flush=mode != "in_place")
        manager.continue_generation(step + 1)
    return trained, rows, held


def _start(tiny, engine, mode: str, version: int, state: dict | None = None):
    """A rollout manager whose worker starts at `version` (the engine is refitted to it), from `state`."""
    from miles.utils.engine_control_http import wait_until_idle

    wait_until_idle(engine.url, {}, 60, "test: idle before the run")
    _set_version(engine.url, tiny[0], str(version), flush=True)
    manager = _manager(tiny, mode)
    manager.connect(engine.url, [engine.url])
    if state is not None:
        manager.load_state_dict(state)
    manager.start_async(version)
    return manager


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_requests_in_flight_across_pauses(tiny, engine, mode):
    from miles.rollout.async_buffer import oldest_version

    manager = _start(tiny, engine, mode, 0)
    try:
        trained, rows, held = _train(manager, engine.url, tiny[0], mode, range(STEPS))
    finally:
        manager.stop_async()
    assert len(trained) == STEPS * 4
    assert all(s.response_length == MAX_LEN for s in trained)  # EOS unreachable: the pause met them running
    spanning = [s for s in trained if len(set(s.weight_versions)) == 2]
    assert spanning, [s.weight_versions for s in trained]
    for s in spanning:  # a held request's segments: consecutive versions, its oldest within the bound
        a, b = sorted(int(v) for v in set(s.weight_versions))
        assert b == a + 1 and a == oldest_version(s)
    assert all(0 <= s.metadata["weight_staleness"] <= BOUND for s in trained)
    continued = sum(r["async/continued_samples"] for r in rows)
    if mode == "abort":
        assert continued > 0 and held == [0] * (STEPS - 1)
    else:
        assert continued == 0 and all(n > 0 for n in held), held
    assert all(r["async/staleness_max"] <= BOUND for r in rows)


def test_resume_with_groups_in_flight_trains_every_prompt_once(tiny, engine):
    """The general resume property (exact equality needs bound 0: tests/e2e/test_fully_async_resume.py): a
    checkpoint written while groups generate restarts them fresh after the resume; over N/2 + resume + N/2 steps
    every prompt drawn is trained exactly once (the data's first N x batch prompts, as in a straight run) and
    every sample is within the bound."""
    import json
    from collections import Counter

    from miles.tools.toy_data import make_rows

    half, mode = 2, "abort"
    first = _start(tiny, engine, mode, 0)
    try:
        trained, rows, _ = _train(first, engine.url, tiny[0], mode, range(half))
        _wait_for_running(engine.url)  # the save meets groups generating
        state = json.loads(json.dumps(first.state_dict(half - 1)))  # as the checkpoint stores it
    finally:
        first.stop_async()
    restart = len(state["async_worker"]["restart"])
    assert restart > 0
    second = _start(tiny, engine, mode, half, state)
    try:
        more, rows2, _ = _train(second, engine.url, tiny[0], mode, range(half, 2 * half))
    finally:
        second.stop_async()
    trained += more
    assert rows2[0]["async/resumed_groups"] == restart
    expected = [row["prompt"] for row in make_rows("echo", 64, seed=0)[: 2 * half * 2]]
    assert Counter(s.prompt for s in trained[::2]) == Counter(expected)  # one sample per group of 2
    assert all(0 <= s.metadata["weight_staleness"] <= BOUND for s in trained)
