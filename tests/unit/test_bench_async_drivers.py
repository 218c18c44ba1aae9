"""The pure parts of scripts/bench/async.py (issue 25): metrics parsing, the engine address in its log, the
steady window, busy fractions, staleness, length statistics, the driver commands. The bench is not run here."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

bench = importlib.import_module("async")  # a keyword: no `import async`
benchlib = importlib.import_module("benchlib")


def test_parse_metrics_sorts_by_step() -> None:
    text = (
        json.dumps({"step": 1, "timing/train": 2.0}) + "\n\n" + json.dumps({"step": 0, "timing/train": 1.0})
    )
    assert [m["step"] for m in bench.parse_metrics(text)] == [0, 1]


def test_engine_address_from_log() -> None:
    log = (
        "Loading weights\n[..] __main__ INFO: embedded engine serving /tmp/m on 127.0.0.1:53387\nWARNING: x\n"
    )
    assert bench.engine_address(log) == "http://127.0.0.1:53387"
    assert bench.engine_address("Loading weights\n") is None


def test_window_rates_and_fractions() -> None:
    ends = [10.0, 14.0, 16.0, 18.0]  # steady steps 1..3 with warmup 1: 10 s -> 18 s
    assert bench.steady_window(ends, 1) == (10.0, 18.0)
    assert bench.samples_per_s(ends, 1, 32) == pytest.approx(3 * 32 / 8.0)
    with pytest.raises(ValueError):
        bench.steady_window(ends[:1], 1)
    polls = [(5.0, True), (11.0, True), (12.0, False), (13.0, False), (17.0, True), (19.0, True)]
    assert bench.busy_fraction(polls, 10.0, 18.0) == pytest.approx(0.5)
    assert math.isnan(bench.busy_fraction(polls, 100.0, 200.0))
    metrics = [{"timing/train": 9.0}, {"timing/train": 2.0}, {"timing/train": 1.0}, {"timing/train": 1.0}]
    assert bench.trainer_busy(metrics, ends, 1) == pytest.approx(4.0 / 8.0)


def test_staleness_measured_or_by_construction() -> None:
    logged = [
        {"async/staleness_mean": 0.0, "async/staleness_max": 0.0},
        {"async/staleness_mean": 1.0, "async/staleness_max": 2.0},
        {"async/staleness_mean": 0.5, "async/staleness_max": 1.0},
    ]
    assert bench.staleness(logged, "fully_async", 1) == (0.75, 2.0, True)
    assert bench.staleness([{}, {}], "one_step_off", 1) == (1.0, 1.0, False)
    assert bench.staleness([{}, {}], "sync", 1) == (0.0, 0.0, False)


def test_length_stats() -> None:
    s = bench.length_stats([10, 12, 8, 11, 9, 10, 100, 10, 10, 13])
    assert (s["median"], s["max"], s["max_over_median"]) == (10, 100, 10.0)
    assert s["p90"] == 13 and bench.length_stats([]) == {}


def test_driver_commands(tmp_path: Path) -> None:
    w, p = bench.LONGTAIL, tmp_path
    sync = bench.driver_command(w, "sync", p / "m", p / "d", p / "r", "1+2", 3, ["--x"])
    fa = bench.driver_command(
        w, "fully_async", p / "m", p / "d", p / "r", "1+2", 3, ["--max-weight-staleness", "2"]
    )
    assert sync[2] == "miles.train" and "--fully-async" not in sync and "--x" not in sync
    assert (
        fa[2] == "miles.train_async" and "--fully-async" in fa and fa[-2:] == ["--max-weight-staleness", "2"]
    )
    assert fa[fa.index("--rollout-num-gpus") + 1] == "2" and "--colocate" not in fa


@pytest.mark.parametrize("argv", [["--placements", "2+2"], ["--drivers", "sync,nope"], ["--repeats", "0"]])
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_counter_delta_interpolates_the_engine_counters() -> None:
    history = [(1.0, {"decode_tokens": 0}), (2.0, {"decode_tokens": 100}), (4.0, {"decode_tokens": 300})]
    assert bench.counter_delta(history, "decode_tokens", 1.5, 3.0) == pytest.approx(200 - 50)
    assert bench.counter_delta(history, "decode_tokens", 0.0, 9.0) == pytest.approx(300)  # flat outside
    assert math.isnan(bench.counter_delta([], "decode_tokens", 0.0, 1.0))


def test_steady_counts_and_the_default_fully_async_flags() -> None:
    metrics = [{"async/discarded_tokens": 50.0}, {"async/discarded_tokens": 7.0}, {}]
    counts = bench.steady_counts(metrics, [[100, 100], [3, 5], [10]], 1)
    assert counts == {"samples": 3.0, "tokens": 18.0, "discarded_tokens": 7.0}
    a = bench.parse_args([])
    assert a.fully_async_args.split() == ["--max-weight-staleness", "2", "--use-tis", "--pause-generation-mode",
                                          "in_place", "--update-weights-interval", "2"]  # fmt: skip
    assert bench.parse_args(["--fully-async-args", ""]).fully_async_args == ""  # no bound: as before


def test_variants_are_fully_async_runs_with_their_own_flags(tmp_path: Path) -> None:
    """`--variant NAME=FLAGS`: another fully async configuration in the same interleaved run, reported on its own
    line with its ratio to sync; bad specs are refused."""
    a = bench.parse_args(["--variant", "inplace=--pause-generation-mode in_place", "--variant", "b=--x 1"])
    assert a.variants == {
        "fully_async[inplace]": "--pause-generation-mode in_place",
        "fully_async[b]": "--x 1",
    }
    assert bench.base_driver("fully_async[inplace]") == "fully_async" and bench.base_driver("sync") == "sync"
    p = tmp_path
    cmd = bench.driver_command(
        bench.LONGTAIL, "fully_async[b]", p / "m", p / "d", p / "r", "1+1", 3, ["--x", "1"]
    )
    assert "--fully-async" in cmd and cmd[-2:] == ["--x", "1"]
    assert bench.staleness([{}, {}], "fully_async[b]", 1)[2] is False
    for bad in (
        ["--variant", "noequals"],
        ["--variant", "a b=--x"],
        ["--variant", "a=1", "--variant", "a=2"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_process_kind_from_the_command_line() -> None:
    k = bench.process_kind
    assert k("ray::TrainWorker.train") == "trainer" and k("ray::TrainWorker") == "trainer"
    assert k("ray::RolloutManager.generate") == "rollout manager"
    assert k("/usr/bin/python3 -m miles.engines.local --model-path /m --port 5") == "engines"
    assert (
        k("python3 -m miles.train_async --fully-async") == "driver"
        and k("python -m miles.train --x") == "driver"
    )
    for other in ("ray::IDLE", "ray::EngineFleet.start", "/x/gcs_server --a", "/x/raylet", "", "python -m"):
        assert k(other) == "ray", other


def test_cpu_cores_by_kind_and_the_ceilings() -> None:
    cmd = {
        1: "python3 -m miles.train",
        2: "ray::TrainWorker",
        3: "python -m miles.engines.local",
        4: "raylet",
    }
    cores = bench.cpu_cores_by_kind({1: 1.0, 2: 4.0, 3: 3.0, 4: 2.0, 5: 10.0}, cmd, 10.0)
    assert cores == pytest.approx(
        {"driver": 0.1, "trainer": 0.4, "engines": 0.3, "ray": 1.2, "rollout manager": 0.0, "total": 2.0}
    )
    # sync: 100 samples/s on 1.6 cores; fully async: 150 samples/s on 2.0 cores
    c = bench.ceilings(100.0, 1.6, 150.0, 2.0, 2)
    assert c["by_cores"] == pytest.approx(1.25)  # 2 / 1.6
    assert c["by_own_cpu"] == pytest.approx(1.5)  # 2 cores / (2.0 / 150 CPU-s per sample) / 100
    assert math.isnan(bench.ceilings(float("nan"), 1.6, 150.0, 2.0, 2)["by_cores"])
    assert math.isnan(bench.ceilings(100.0, 1.6, float("nan"), 2.0, 2)["by_own_cpu"])


def test_cpu_time_from_proc_and_its_delta_over_a_window() -> None:
    # fields after the command: state ppid ... utime (14th field of stat) stime (15th)
    stat = "42 (a) b) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 7 7 20 0 1"
    assert benchlib.parse_cpu_s(stat) == pytest.approx(300 / benchlib.TICKS)
    # pid 1 runs all along (1 CPU-s per s), pid 2 appears after t=1 and ends after t=2, pid 3 is there at t=0
    history = [(0.0, {1: 10.0, 3: 5.0}), (1.0, {1: 11.0, 3: 5.0}), (2.0, {1: 12.0, 2: 0.5, 3: 5.0}),
               (3.0, {1: 13.0, 3: 5.5})]  # fmt: skip
    d = benchlib.cpu_delta(history, 0.5, 2.5)
    assert d[1] == pytest.approx(2.0) and d[2] == pytest.approx(0.5) and d[3] == pytest.approx(0.25)
    assert set(benchlib.cpu_delta(history, -5.0, 0.0).values()) == {0.0}  # flat before the first sample
    assert benchlib.cpu_delta([], 0.0, 1.0) == {}


def test_machine_busy_time_from_proc_stat() -> None:
    text = "cpu  100 20 30 900 50 5 5 10 7 0\ncpu0 1 2 3 4 5 6 7 8 9 0\n"
    assert benchlib.parse_busy_cpu_s(text) == pytest.approx((100 + 20 + 30 + 5 + 5 + 10) / benchlib.TICKS)


def test_the_report_prints_cpu_by_kind_the_ceilings_and_a_busy_machine() -> None:
    def run(driver: str, sps: float, kinds: dict[str, float], others: float) -> object:
        r = bench.Run(
            driver, "1+2", 0, 4, 0, samples_per_s=sps, cpu_kinds={**kinds, "total": sum(kinds.values())}
        )
        r.cpu_cores, r.cpu_others, r.cpu_ms_per_sample = (
            sum(kinds.values()),
            others,
            1e3 * sum(kinds.values()) / sps,
        )
        return r

    runs = [run("sync", 100.0, {"trainer": 1.0, "engines": 0.6}, 0.0),
            run("fully_async", 150.0, {"trainer": 0.8, "engines": 1.2}, 0.0)]  # fmt: skip
    text, out = bench.format_report(bench.LONGTAIL, runs, ["1+2"])
    assert out["1+2"]["cpu_ceiling"]["by_cores"] == pytest.approx(bench.CORES / 1.6)
    assert "trainer 10.00, engines 6.00" in text  # sync's CPU-ms per sample by kind
    assert "measured 1.50x" in text and "not a quiet machine" not in text
    runs[0].cpu_others = 1.0
    assert "other processes used 0.50 cores" in bench.format_report(bench.LONGTAIL, runs, ["1+2"])[0]


def test_reward_means_last_quarter_and_second_half() -> None:
    rewards = [0.0, 0.0, 0.0, 0.0, 0.2, 0.2, 0.4, 0.6]
    assert bench.reward_means(rewards) == pytest.approx((0.6, 0.5, 0.35))
    assert all(math.isnan(x) for x in bench.reward_means([]))
