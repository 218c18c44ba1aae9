"""Pure parts of the GPU check (miles.tools.gpu_check): command line, synthetic samples, the generation verdict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.tools.gpu_check.__main__ import parse_args
from miles.tools.gpu_check.common import POWER, TOLERANCES, Settings, training_samples
from miles.tools.gpu_check.models import PRESETS, qwen3_config
from miles.tools.gpu_check.refit import check_generation


def _settings(dtype=torch.float32, num_seqs=8, seq_len=40) -> Settings:
    return Settings(
        device=torch.device("cpu"), dtype=dtype, preset_name="tiny", preset=PRESETS["tiny"], workdir=Path("."),
        num_seqs=num_seqs, seq_len=seq_len, max_tokens_per_mb=4 * seq_len, gen_prompts=2, gen_tokens=4,
        bucket_bytes=1 << 20,
    )  # fmt: skip


def test_defaults_follow_the_device():
    gpu, cpu = parse_args([]), parse_args(["--device", "cpu"])
    assert (gpu.preset, gpu.num_seqs, gpu.seq_len, gpu.max_tokens_per_mb) == ("0.6b", 16, 1024, 4096)
    assert (cpu.preset, cpu.num_seqs, cpu.seq_len) == ("tiny", 4, 32)
    assert cpu.checks == ["train", "varlen", "refit"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "7b"], "--preset '7b': allowed"),
        (["--num-seqs", "3"], "--num-seqs 3: must be even"),
        (["--seq-len", "64", "--max-tokens-per-mb", "32"], "--seq-len 64 must be >= 8 and <="),
        (["--checks", "train,speed"], "--checks ['speed']: allowed"),
    ],
)
def test_bad_command_lines_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_presets_are_qwen3_shapes():
    c = qwen3_config(PRESETS["0.6b"])
    assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.vocab_size) == ("qwen3", 1024, 28, 151936)
    assert c.num_attention_heads * c.head_dim == 2048 and c.tie_word_embeddings


def test_training_samples_come_in_pairs_with_different_rewards():
    s = _settings()
    samples = training_samples(s)
    assert len(samples) == 8 and max(len(x.tokens) for x in samples) == 40
    assert len({len(x.tokens) for x in samples}) == 4  # several lengths, so packing has work
    for a, b in zip(samples[::2], samples[1::2]):
        assert a.group_index == b.group_index and a.reward != b.reward
    for x in samples:
        assert len(x.loss_mask) == x.response_length < len(x.tokens)
        assert all(3 <= t < s.preset.vocab_size for t in x.tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generation_verdict(dtype):
    s = _settings(dtype)
    tol = TOLERANCES[("cpu", dtype)]
    strong = {"mean": 100 * tol.gen_mean, "max": 1.0, "tokens": 8}
    good = {"mean": tol.gen_mean / 2, "max": tol.gen_max / 2, "tokens": 8}
    assert check_generation(strong, good, s).passed
    assert not check_generation(strong, {**good, "mean": 2 * tol.gen_mean}, s).passed
    assert not check_generation(strong, {**good, "max": 2 * tol.gen_max}, s).passed
    weak = {**strong, "mean": (POWER - 1) * tol.gen_mean}  # a model too flat to show a wrong weight
    result = check_generation(weak, good, s)
    assert not result.passed and "could not show a wrong weight" in result.summary
