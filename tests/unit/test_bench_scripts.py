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
    assert cfg.seed == 1 and cfg.rollout.rollout_seed == 1  # the default seed, both streams
    seeded = parse_config(
        vs_trl.miles_command(w, tmp_path / "m", tmp_path / "d", tmp_path / "r", placement, 7)[3:]
    )
    assert seeded.seed == 7 and seeded.rollout.rollout_seed == 7


def test_both_systems_get_the_shared_settings(tmp_path: Path) -> None:
    """miles' flags and TRL's GRPOConfig arguments both carry bench_workloads.SHARED (TRL's own defaults for the
    optimizer are not relied on: a transformers release that changed them would change the experiment)."""
    from miles.config import parse_config

    s, w = bw.SHARED, bw.get_workload("quickstart")
    cfg = parse_config(
        vs_trl.miles_command(w, tmp_path / "m", tmp_path / "d", tmp_path / "r", "colocate1")[3:]
    )
    kw = trl_child.grpo_config_kwargs(dataclasses.asdict(w), "/tmp/x", seed=1)
    pairs = [
        (cfg.rollout.rollout_temperature, kw["temperature"], s.temperature),
        (cfg.rollout.rollout_top_p, kw["top_p"], s.top_p),
        (cfg.algo.eps_clip, kw["epsilon"], s.eps_clip),
        (cfg.algo.eps_clip_high, kw["epsilon_high"], s.eps_clip_high),
        (cfg.optim.clip_grad, kw["max_grad_norm"], s.clip_grad),
        (cfg.optim.adam_beta1, kw["adam_beta1"], s.adam_beta1),
        (cfg.optim.adam_beta2, kw["adam_beta2"], s.adam_beta2),
        (cfg.optim.adam_eps, kw["adam_epsilon"], s.adam_eps),
        (cfg.optim.weight_decay, kw["weight_decay"], s.weight_decay),
    ]
    assert all(m == t == v for m, t, v in pairs), pairs
    assert cfg.rollout.rollout_skip_special_tokens is s.skip_special_tokens is True  # TRL's decode drops them
    assert cfg.rollout.rollout_top_k == -1 and kw["top_k"] == 0  # both spellings of "off"


@pytest.mark.parametrize("name", sorted(bw.WORKLOADS))
def test_trl_config_matches_the_workload(name: str) -> None:
    w = bw.get_workload(name)
    kw = trl_child.grpo_config_kwargs(dataclasses.asdict(w), "/tmp/x", seed=1)
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == w.samples_per_step
    assert kw["num_generations"] == w.n_samples and kw["max_completion_length"] == w.max_response_len
    assert kw["learning_rate"] == w.lr and kw["max_steps"] == w.steps and kw["beta"] == 0.0
    assert kw["loss_type"] == "grpo" and kw["lr_scheduler_type"] == "constant" and not kw["shuffle_dataset"]


def test_installed_trl_venv_needs_the_finished_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_TRL_VENV", str(tmp_path))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    assert vs_trl.installed_trl_venv() is None  # no stamp: the install did not finish
    (tmp_path / vs_trl.STAMP).write_text("trl==x\n")
    assert vs_trl.installed_trl_venv() == tmp_path


# ------------------------------------------------------------------------------------------------ settings
def test_settings_texts_spell_off_the_same_for_both_systems() -> None:
    off = "temperature 1, top-p off, top-k off, min-p off, repetition penalty off"
    assert bw.sampling_text(1.0, 1.0, -1, None, None) == off  # SGLang's spelling of "no top-k"
    assert bw.sampling_text(1.0, 1.0, 0, 0.0, 1.0) == off  # transformers'
    assert bw.sampling_text(0.7, 0.95, 50, 0.1, 1.2) == (
        "temperature 0.7, top-p 0.95, top-k 50, min-p 0.1, repetition penalty 1.2"
    )
    assert bw.lr_per_step_text([5e-3] * 40) == "0.005 at all 40 steps"
    assert bw.lr_per_step_text([1e-3, 2e-3, 3e-3]) == "0.001 first, 0.003 last, 0.001-0.003 over 3 steps"
    assert bw.lr_per_step_text([]) == "not logged"


def test_settings_table_marks_differences_but_not_seeds() -> None:
    base = {k: f"v-{k}" for k in bw.SETTING_ROWS}
    other = {**base, "sampling": "top-k 50", "seed": "2"}
    assert bw.settings_mismatches(base, base) == []
    assert bw.settings_mismatches(base, other) == ["sampling"]
    assert bw.settings_mismatches(base, {}) == [k for k in bw.SETTING_ROWS if k != "seed"]
    lines = bw.format_settings(base, other, indent="")
    assert len(lines) == len(bw.SETTING_ROWS)
    by_row = dict(zip(bw.SETTING_ROWS, lines))
    assert by_row["grad clip"].endswith("v-grad clip (both)")
    assert by_row["sampling"].endswith("miles v-sampling | TRL top-k 50  <-- DIFFERS")
    assert by_row["seed"].endswith("miles v-seed | TRL 2")


def test_miles_settings_read_the_parsed_config(tmp_path: Path) -> None:
    """miles' side of the table comes from its parsed config, so a flag that changes the experiment changes it."""
    w = bw.get_workload("quickstart")
    model = bw.build_model(w, tmp_path / "model")
    cmd = vs_trl.miles_command(w, model, tmp_path / "d.jsonl", tmp_path / "run", "colocate2", seed=3)
    got = vs_trl.miles_settings(cmd, model)
    assert set(got) == set(bw.SETTING_ROWS) - {"lr logged per step"}  # that row comes from the run's metrics
    assert got["prompts x samples per rollout"] == "16 x 8" and got["optimizer steps per rollout"] == "1"
    assert got["sampling"] == "temperature 1, top-p off, top-k off, min-p off, repetition penalty off"
    assert got["stop token ids"] == "[2]" and got["reward text"] == "special tokens dropped"
    assert got["policy loss"] == "PPO clip 0.2/0.28, sample_mean" and got["KL"] == "off"
    assert got["optimizer"] == "AdamW betas (0.9, 0.999) eps 1e-08 weight decay 0"
    assert got["lr schedule"] == "0.005 constant, warmup 0 steps" and got["seed"] == "3 (sampling 3)"
    assert got["prompt format"] == "chat template" and got["advantages"] == "group mean / group std"
    changed = vs_trl.miles_settings(
        cmd + ["--rollout-top-k", "50", "--loss-reduction", "token_mean", "--lr-warmup-iters", "2",
               "--use-kl-loss", "--kl-loss-coef", "0.1", "--rollout-stop-token-ids", "5"],
        model,
    )  # fmt: skip
    assert bw.settings_mismatches(got, changed) == [
        "sampling", "stop token ids", "policy loss", "KL", "lr schedule"
    ]  # fmt: skip
    assert changed["stop token ids"] == "[2, 5]" and changed["KL"] == "loss k1 x0.1"


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
        system=system, workload="quickstart", repeat=repeat, seed=1 + repeat, placement=None, returncode=rc,
        wall_s=ends[-1],
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


def test_vs_trl_reward_curves_and_seeds() -> None:
    """The reward lines: each system's mean curve over its successful runs, and each seed's last reward (a
    collapsed seed is shown, not hidden in a median)."""
    recs = [
        _rec("miles", 0, [1.0, 2.0, 3.0, 4.0]),
        _rec("trl", 0, [1.0, 2.0, 3.0, 4.0], reward=0.2),
        _rec("miles", 1, [1.0, 2.0, 3.0, 4.0], reward=0.9),
        _rec("trl", 1, [1.0, 2.0, 3.0, 4.0], reward=0.8),
        _rec("trl", 2, [1.0, 2.0, 3.0, 4.0], reward=0.0, rc=1),  # failed: left out
    ]
    for r, rewards in zip(
        recs, ([0.1, 0.3, 0.5], [0.0, 0.1, 0.2], [0.1, 0.5, 0.9], [0.2, 0.5, 0.8], [9, 9, 9])
    ):
        r.rewards = rewards
    lines, js = vs_trl.reward_lines(recs)
    assert js["reward_curve"]["miles"] == pytest.approx([0.1, 0.4, 0.7])
    assert js["reward_curve"]["trl"] == pytest.approx([0.1, 0.3, 0.5])
    assert js["reward_at_last_by_seed"] == {"miles": {1: 0.5, 2: 0.9}, "trl": {1: 0.2, 2: 0.8}}
    assert "steps 1/2/3: miles 0.10 0.40 0.70 | trl 0.10 0.30 0.50" in lines[0]
    assert lines[1] == "   reward@last by seed: miles s1:0.50 s2:0.90 | trl s1:0.20 s2:0.80"
    assert vs_trl.curve_steps(40) == [1, 10, 20, 30, 40] and vs_trl.curve_steps(1) == [1]
    assert vs_trl.curve_steps(0) == []
    assert vs_trl.reward_curve([_rec("miles", 0, [1.0], rc=1)]) == []


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
