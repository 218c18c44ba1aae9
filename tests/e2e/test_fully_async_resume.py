"""--fully-async resume (issue 25 item 4): with --max-weight-staleness 0 and --update-weights-interval 1, N steps
straight equal N/2, `--load`, N/2 more: the same samples trained (tokens, weight versions, staleness) and the
same metrics lines (timing, and the worker's timing gauges `GAUGES`, aside). With bound 0 nothing is buffered or in flight when a step's checkpoint is written (the
pacing rule admits the next batch only after the refit), so the checkpoint's admission count and data cursor
are all the resumed worker needs to send the same requests. The general case (groups in flight at the save
restart fresh) is tests/integration/test_fully_async_in_flight_pause.py's."""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_exact_resume import ENGINE_LOGPROB_KEYS, VOLATILE
from tests.e2e.test_fully_async_driver import _argv, _rows, _trained_samples

pytestmark = pytest.mark.slow

N = 2
# gauges of the worker's progress when the batch was taken (groups still finishing their bookkeeping count as in
# flight): they depend on thread timing, not on what was trained
GAUGES = ("async/in_flight_groups", "async/buffered_groups")


def _run(tmp_path, run: str, steps: int, *extra: str) -> list[str]:
    run_dir = str(tmp_path / run)
    flags = ["--fully-async", "--max-weight-staleness", "0", "--pause-generation-mode", "abort"]
    ckpt = ["--save", os.path.join(run_dir, "ckpt"), "--save-interval", "1"]
    return _argv(tmp_path, run, "--num-rollout", str(steps), *flags, *ckpt, *extra)


def test_n_straight_equals_half_resume_half(tmp_path, capfd):
    from miles.train_async import main

    assert main(_run(tmp_path, "straight", N)) == 0
    assert main(_run(tmp_path, "resumed", N // 2)) == 0
    load = os.path.join(tmp_path / "resumed", "ckpt")
    assert main(_run(tmp_path, "resumed", N, "--load", load)) == 0
    assert f"at rollout {N // 2}" in capfd.readouterr().out

    straight, resumed = _trained_samples(tmp_path / "straight"), _trained_samples(tmp_path / "resumed")
    assert len(straight) == len(resumed) == N * 16
    for key in ("tokens", "weight_versions", "index"):
        assert [s[key] for s in resumed] == [s[key] for s in straight], key
    assert [s["metadata"]["weight_staleness"] for s in resumed] == [0] * (N * 16)
    for a, b in zip(straight, resumed, strict=True):  # the engine's batched decode: see ENGINE_LOGPROB_KEYS
        assert max(abs(x - y) for x, y in zip(a["rollout_log_probs"], b["rollout_log_probs"])) <= 1e-6

    rows_a, rows_b = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == list(range(N))
    for step, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        keep = [k for k in ra.keys() | rb.keys() if not k.startswith(VOLATILE) and k not in GAUGES]
        exact = [k for k in keep if k not in ENGINE_LOGPROB_KEYS]
        assert {k: ra.get(k) for k in exact} == {k: rb.get(k) for k in exact}, step
        assert all(abs(ra[k] - rb[k]) <= 1e-6 for k in keep if k in ENGINE_LOGPROB_KEYS), step
    assert all(r["async/resumed_groups"] == 0 for r in rows_b)
    assert any(r["train/grad_norm"] > 0 for r in rows_a)  # the weights moved: the comparison is not vacuous
