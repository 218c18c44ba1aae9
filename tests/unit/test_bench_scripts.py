"""The pure parts of the benchmarks in scripts/bench (vs_trl.py, refit.py): argument parsing, workload builders,
the EOS schedule of the benchmark models, and the report maths. The benchmarks themselves are not run here."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import bench_workloads as bw  # noqa: E402
import benchlib  # noqa: E402
import refit  # noqa: E402
import trl_child  # noqa: E402
import vs_trl  # noqa: E402


# ------------------------------------------------------------------------------------------------ arguments
def test_vs_trl_defaults_and_quick() -> None:
    a = vs_trl.parse_args([])
    assert a.workload_names == ["quickstart", "compute", "varlen"] and a.system_names == ["miles", "trl"]
    assert a.repeats == 2
    q = vs_trl.parse_args(["--quick", "--workloads", "varlen", "--repeats", "3"])
    assert q.repeats == 1
    (w,) = vs_trl.resolve_workloads(q)
    full = bw.get_workload("varlen")
    assert w.steps == 3 and w.hidden_size <= 128 and w.max_response_len < full.max_response_len
    (s,) = vs_trl.resolve_workloads(vs_trl.parse_args(["--workloads", "compute", "--steps", "2"]))
    assert (s.steps, s.warmup_steps) == (2, 1)


@pytest.mark.parametrize(
    "argv",
    [["--workloads", "nope"], ["--systems", "miles,vllm"], ["--repeats", "0"], ["--steps", "1"],
     ["--placement", "colocate9"]],
)  # fmt: skip
def test_vs_trl_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        vs_trl.parse_args(argv)


@pytest.mark.parametrize("argv", [["--trainers", "0"], ["--bucket-mb", "0"], ["--repeats", "0"]])
def test_refit_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        refit.parse_args(argv)


@pytest.mark.parametrize("name", sorted(bw.WORKLOADS))
@pytest.mark.parametrize("placement", sorted(vs_trl.PLACEMENTS))
def test_miles_command_passes_miles_config_validation(name: str, placement: str, tmp_path: Path) -> None:
    from miles.config import parse_config

    w = bw.get_workload(name)
    cmd = vs_trl.miles_command(w, tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", placement)
    assert cmd[1:3] == ["-m", "miles.train"]
    cfg = parse_config(cmd[3:])
    assert cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt == cfg.train.global_batch_size
    assert cfg.rollout.rollout_max_response_len == w.max_response_len and cfg.optim.lr == w.lr
    assert cfg.cluster.colocate == vs_trl.PLACEMENTS[placement][2]
    assert cfg.data.apply_chat_template == w.chat and not cfg.data.rollout_shuffle


@pytest.mark.parametrize("name", sorted(bw.WORKLOADS))
def test_trl_config_matches_the_workload(name: str) -> None:
    w = bw.get_workload(name)
    kw = trl_child.grpo_config_kwargs(dataclasses.asdict(w), "/tmp/x", seed=1)
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == w.samples_per_step
    assert kw["num_generations"] == w.n_samples and kw["max_completion_length"] == w.max_response_len
    assert kw["learning_rate"] == w.lr and kw["max_steps"] == w.steps and kw["beta"] == 0.0
    assert kw["loss_type"] == "grpo" and kw["lr_scheduler_type"] == "constant" and not kw["shuffle_dataset"]


# ------------------------------------------------------------------------------------------------ workloads
@pytest.mark.parametrize(
    "change",
    [dict(eos_mode="sometimes"), dict(eos_mode="never", tie_word_embeddings=True), dict(steps=1, warmup_steps=1),
     dict(micro_batch_size=48)],
)  # fmt: skip
def test_workload_validation(change: dict) -> None:
    with pytest.raises(ValueError, match="workload quickstart"):
        dataclasses.replace(bw.get_workload("quickstart"), **change)
    with pytest.raises(ValueError, match="unknown workload"):
        bw.get_workload("huge")


def test_rows_echo_and_markers() -> None:
    quick = bw.make_rows(bw.get_workload("quickstart"), 8, seed=0)
    assert all(isinstance(r["prompt"], list) and r["prompt"][0]["role"] == "user" for r in quick)
    w = bw.get_workload("varlen")
    rows = bw.make_rows(w, 200, seed=0)
    assert rows == bw.make_rows(w, 200, seed=0)
    counts = []
    for r in rows:
        head, markers = r["prompt"].rsplit(" ", 1)
        assert head == "echo " + " ".join([r["label"]] * 4) and set(markers) == {bw.MARKER}
        counts.append(len(markers))
    assert counts == bw.marker_counts(200, w.marker_median, w.marker_sigma, seed=1)
    assert 2 <= min(counts) and max(counts) <= 180 and len(set(counts)) > 30
    median = sorted(counts)[100]
    assert 0.8 * w.marker_median <= median <= 1.2 * w.marker_median


def _eos_logprob(model, eos: int, ids: list[int]) -> float:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    return float(torch.log_softmax(logits, -1)[eos])


def test_schedule_eos_never_and_prompt_timed() -> None:
    """'never': EOS is unreachable; 'prompt_timed': EOS gets likelier as the marker fraction of the context
    falls (longer response, fewer markers) and is improbable right after a marker-heavy prompt."""
    import torch

    from miles.tools.tiny_model import tiny_config, tiny_model

    cfg = tiny_config(48, tie_word_embeddings=False)  # hidden 64, 4 heads / 2 KV heads, head_dim 16
    eos, marker, pad, filler = 2, 3, 0, [7, 30, 9, 30, 11]
    never = tiny_model(cfg, seed=0)
    bw.schedule_eos(never, eos, [marker], [pad], "never")
    assert _eos_logprob(never, eos, [33, 30, 7] + filler * 4) < -15
    timed = tiny_model(cfg, seed=0)
    bw.schedule_eos(timed, eos, [marker], [pad], "prompt_timed")
    prompt = [33, 30, 7, 30] + [marker] * 30
    lp = [_eos_logprob(timed, eos, prompt + filler * k) for k in (0, 4, 12, 30)]
    # (the designed logit B0 - KAPPA * m is scaled by how far the final RMS at a position is from the measured one)
    assert lp[0] < math.log(0.02) and lp[-1] > math.log(0.05) and lp[-1] - lp[0] > 2.0
    assert lp == sorted(lp)  # monotone in the response length
    # markers and the pad token are never sampled
    with torch.no_grad():
        probs = torch.softmax(
            timed(input_ids=torch.tensor([prompt + filler]), use_cache=False).logits[0, -1], -1
        )
    assert float(probs[marker]) < 1e-6 and float(probs[pad]) < 1e-6  # never sampled in practice


def test_build_model_quick_varlen_loads_and_counts(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = bw.get_workload("varlen").quick()
    out = bw.build_model(w, tmp_path / "m")
    assert not (tmp_path / "m.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size == w.hidden_size and not model.config.tie_word_embeddings
    assert tok.convert_tokens_to_ids(bw.MARKER) != tok.unk_token_id
    ids = tok(bw.make_rows(w, 1)[0]["prompt"])["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids(bw.MARKER)) >= 2


# ------------------------------------------------------------------------------------------------ benchlib
def test_proc_parsing_and_tree() -> None:
    assert benchlib.parse_ppid("12 (a b) c)) S 7 12 12 0") == 7
    assert sorted(benchlib.descendants(1, {1: 0, 2: 1, 3: 2, 4: 9, 5: 3})) == [1, 2, 3, 5]
    assert benchlib.parse_pss_kib("Rss:  100 kB\nPss:   42 kB\n") == 42 and benchlib.parse_pss_kib("") == 0
    rss, pss, n = benchlib.tree_memory(os.getpid())
    assert n >= 1 and rss > 10 * 2**20 and 0 < pss <= rss * 1.01


def test_spread_and_intervals() -> None:
    s = benchlib.Spread.of([3.0, 1.0, float("nan"), 2.0])
    assert (s.median, s.lo, s.hi, s.n) == (2.0, 1.0, 3.0, 3)
    assert (
        s.fmt() == "2 [1-3]"
        and benchlib.Spread.of([]).fmt() == "n/a"
        and benchlib.Spread.of([1.5]).fmt() == "1.5"
    )
    assert benchlib.step_intervals([10.0, 12.0, 15.0, 16.0], warmup=1) == [2.0, 3.0, 1.0]
    assert benchlib.step_intervals([10.0, 12.0, 15.0, 16.0], warmup=2) == [3.0, 1.0]
    with pytest.raises(ValueError, match="warmup"):
        benchlib.step_intervals([1.0], warmup=0)


# ------------------------------------------------------------------------------------------------ reports
def _rec(
    system: str,
    repeat: int,
    ends: list[float],
    reward: float = 0.5,
    rc: int = 0,
    lens: list[float] | None = None,
) -> vs_trl.RunRecord:
    return vs_trl.RunRecord(
        system=system, workload="quickstart", repeat=repeat, placement=None, returncode=rc, wall_s=ends[-1],
        startup_s=5.0 + repeat, step_end_s=ends, rewards=[0.1, reward], response_lens=lens or [2.0, 4.0],
        peak_rss=200 * 2**20, peak_pss=100 * 2**20 * (2 if system == "miles" else 1),
    )  # fmt: skip


def test_vs_trl_report_maths() -> None:
    w = dataclasses.replace(bw.get_workload("quickstart"), steps=4, warmup_steps=1)
    recs = [
        _rec("miles", 0, [30.0, 32.0, 34.0, 36.0]),  # steady 2 s/step
        _rec("trl", 0, [10.0, 11.0, 12.0, 13.0]),  # 1 s/step
        _rec("miles", 1, [30.0, 34.0, 38.0, 42.0], reward=0.7),  # 4 s/step
        _rec("trl", 1, [10.0, 11.0, 12.0, 13.0]),
        _rec("miles", 2, [1.0, 2.0, 3.0, 4.0], rc=1),  # failed: left out
    ]
    m = vs_trl.summarize_system([r for r in recs if r.system == "miles"], 1, 128)
    assert (m.step_s.median, m.step_s.lo, m.step_s.hi) == (3.0, 2.0, 4.0) and (m.runs, m.failed) == (3, 1)
    assert m.samples_per_s.median == pytest.approx((64 + 32) / 2) and m.final_reward.median == pytest.approx(
        0.6
    )
    assert m.response_len.median == 3.0 and m.startup_s.median == 5.5 and m.peak_pss_mib.median == 200
    pairs = vs_trl.pair_ratios(
        [r for r in recs if r.system == "miles"], [r for r in recs if r.system == "trl"], 1
    )
    assert (pairs.lo, pairs.hi) == (0.25, 0.5)
    text, summary = vs_trl.format_report([w], recs, {"quickstart": "colocate2"})
    assert summary["quickstart"]["ratio_samples_per_s"] == pytest.approx(48 / 128)
    assert summary["quickstart"]["ratio_samples_per_s_best"] == pytest.approx(64 / 128)
    assert summary["quickstart"]["ratio_peak_pss"] == pytest.approx(2.0)
    assert "miles/TRL samples/s: 0.38x" in text and "colocate2" in text


def test_vs_trl_response_token_rate() -> None:
    """Response tokens/s counts only the steady steps' tokens over their time, so a system whose responses get
    shorter as it learns is not credited with more speed than it has."""
    w = dataclasses.replace(bw.get_workload("varlen"), steps=4, warmup_steps=1)
    m = _rec("miles", 0, [30.0, 32.0, 34.0, 36.0], lens=[100.0, 40.0, 40.0, 40.0])  # 40 * 128 / 2 s
    t = _rec("trl", 0, [10.0, 11.0, 12.0, 14.0], lens=[100.0, 10.0, 10.0, 40.0])  # (10+10+40) * 128 / 4 s
    for r in (m, t):
        r.workload = "varlen"
    sm = vs_trl.summarize_system([m], 1, 128)
    st = vs_trl.summarize_system([t], 1, 128)
    assert sm.response_tokens_per_s.median == pytest.approx(40 * 128 / 2)
    assert st.response_tokens_per_s.median == pytest.approx(60 * 128 / 4)
    text, summary = vs_trl.format_report([w], [m, t], {"varlen": "colocate2"})
    assert summary["varlen"]["ratio_response_tokens_per_s"] == pytest.approx((40 * 128 / 2) / (60 * 128 / 4))
    assert "response tokens/s: 1.33x" in text
    assert vs_trl.response_token_rate([1.0, 2.0], [10.0, 11.0], 1, 8) == pytest.approx(88.0)
    assert vs_trl.response_token_rate([1.0, 2.0], [10.0], 1, 8) is None  # a length per step is needed


def test_refit_summary() -> None:
    r = refit.RefitResult(
        model_bytes=10**8, engines=2, buckets=1, bucket_bytes=2**29, refit_s=[2.0, 1.0, 4.0],
        memcpy_s=[0.02, 0.02], memcpy_threads=2,
    )  # fmt: skip
    s = refit.summarize(r)
    assert s.bytes == 2 * 10**8 and s.refit_gbps.median == pytest.approx(0.1) and s.memcpy_gbps.median == 10.0
    assert s.ratio == pytest.approx(0.01) and s.refit_s.median == 2.0
    assert "refit / memcpy bandwidth: 0.0100" in refit.format_summary(s, r)


# ------------------------------------------------------------------------------------------------ engine.py
def test_engine_bench_arguments_and_prompts(tmp_path: Path) -> None:
    import engine as engine_bench

    a = engine_bench.parse_args([])
    assert (a.models, a.batch_sizes, a.modes, a.baseline_src) == (
        ["tiny", "25m"],
        [1, 8, 64],
        ["inproc", "http"],
        None,
    )
    for argv in (
        ["--models", "7b"],
        ["--modes", "grpc"],
        ["--batch-sizes", "0,8"],
        ["--baseline-src", str(tmp_path)],
    ):
        with pytest.raises(SystemExit):
            engine_bench.parse_args(argv)
    prompts = engine_bench.make_prompts(64, vocab=48, seed=3)
    assert prompts == engine_bench.make_prompts(64, vocab=48, seed=3) != engine_bench.make_prompts(64, 48, 4)
    assert all(8 <= len(p) <= 24 and min(p) >= 3 and max(p) < 48 for p in prompts)
    outs = [{"output_ids": [1] * 5}, {"output_ids": [2] * 5}]
    assert engine_bench._count(outs, 5) == 10
    with pytest.raises(AssertionError, match="lengths"):
        engine_bench._count(
            [{"output_ids": [1] * 4}], 5
        )  # an early stop would inflate nothing but must not pass


def test_engine_bench_baseline_wrapper_puts_the_other_tree_first(tmp_path: Path) -> None:
    import engine as engine_bench

    src = tmp_path / "src"
    (src / "miles" / "engines" / "local").mkdir(parents=True)
    assert engine_bench.parse_args(["--baseline-src", str(src)]).baseline_src == str(src)
    wrapper = Path(engine_bench.baseline_python(str(src), tmp_path))
    assert os.access(wrapper, os.X_OK)
    # `python -m` puts the working directory before PYTHONPATH: the wrapper must cd there as well
    assert f'cd "{src.resolve()}"' in wrapper.read_text()
    assert f'PYTHONPATH="{src.resolve()}:$PYTHONPATH" exec "{sys.executable}" "$@"' in wrapper.read_text()
