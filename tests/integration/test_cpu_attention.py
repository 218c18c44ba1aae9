"""The embedded engine's CPU decode-attention kernel against a plain loop, and how the engine falls back without it."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from miles.engines.local import cpu_attention
from miles.engines.local.__main__ import parse_args
from miles.engines.local.model_runner import PoolRunner, make_runner

torch.set_num_threads(1)

needs_compiler = pytest.mark.skipif(
    cpu_attention.find_compiler() is None, reason="no C compiler ($CC, gcc, cc)"
)


def _loop_reference(q, keys, values, slots, lengths, scale):
    """Row by row, head by head: softmax(q . k * scale) @ v over the row's first `length` positions."""
    rows, heads, d = q.shape
    group = heads // keys.shape[2]
    out = torch.zeros(rows, heads, d, dtype=torch.float64)
    for i in range(rows):
        n, s = int(lengths[i]), int(slots[i])
        for j in range(heads):
            k = keys[:n, s, j // group].double()
            v = values[:n, s, j // group].double()
            w = torch.softmax((k @ (q[i, j].double() * scale)), 0)
            out[i, j] = w @ v
    return out.reshape(rows, heads * d)


@needs_compiler
@pytest.mark.parametrize(
    "kv_heads,group,head_dim,rows,num_slots",
    [(4, 2, 64, 13, 16), (2, 2, 8, 5, 5), (1, 4, 16, 1, 3), (3, 1, 24, 7, 9), (2, 3, 128, 4, 6)],
)
def test_kernel_matches_a_plain_loop(kv_heads, group, head_dim, rows, num_slots):
    """Any shape the loader accepts (head dim 8k: 8- and 16-float vectors), rows on scattered slots, lengths from
    1 to past a tile, NaN in every pool position a row does not see (the kernel must never read it)."""
    kernel = cpu_attention.load_decode_attention(kv_heads, group, head_dim)
    assert kernel is not None
    gen = torch.Generator().manual_seed(kv_heads * 100 + head_dim)
    capacity = 40
    pool = torch.full((2, capacity, num_slots, kv_heads, head_dim), math.nan)
    slots = torch.randperm(num_slots, generator=gen)[:rows]
    lengths = torch.randint(1, 30, (rows,), generator=gen)
    lengths[0] = 1
    if rows > 1:
        lengths[1] = 19  # not a multiple of the kernel's tile of 8 positions
    for i in range(rows):
        n, s = int(lengths[i]), int(slots[i])
        pool[:, :n, s] = torch.randn(2, n, kv_heads, head_dim, generator=gen)
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = kernel(q, pool[0], pool[1], slots, lengths, int(lengths.max()), scale)
    ref = _loop_reference(q, pool[0], pool[1], slots, lengths, scale)
    assert out.shape == (rows, kv_heads * group * head_dim)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@needs_compiler
def test_extreme_scores_stay_finite():
    """Scores far apart (one key dominates, others underflow to weight 0) and all equal (uniform weights)."""
    kernel = cpu_attention.load_decode_attention(1, 1, 8)
    assert kernel is not None
    keys = torch.zeros(6, 2, 1, 8)
    values = torch.arange(6 * 2 * 8, dtype=torch.float32).reshape(6, 2, 1, 8)
    keys[3, 0, 0, 0] = 1e4  # slot 0: position 3 wins outright; slot 1: all scores 0
    q = torch.zeros(2, 1, 8)
    q[0, 0, 0] = 10.0
    out = kernel(q, keys, values, torch.tensor([0, 1]), torch.tensor([6, 5]), 6, 1.0)
    torch.testing.assert_close(out[0], values[3, 0, 0])
    torch.testing.assert_close(out[1], values[:5, 1, 0].mean(0))


@needs_compiler
def test_kernel_refuses_a_tensor_it_would_misread():
    kernel = cpu_attention.load_decode_attention(2, 1, 8)
    assert kernel is not None
    pool = torch.zeros(4, 3, 2, 8)
    q = torch.zeros(1, 2, 8)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="keys"):
        kernel(q, pool.transpose(0, 1), pool, one, one + 1, 1, 1.0)
    with pytest.raises(ValueError, match="values .* float32"):
        kernel(q, pool, pool.double(), one, one + 1, 1, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernel(q, pool, pool, one.int(), one + 1, 1, 1.0)


def _qwen3(num_heads: int = 4, kv_heads: int = 2, head_dim: int = 8):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=128,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def _decode_logits(runner: PoolRunner) -> tuple[torch.Tensor, list]:
    """Prefill three prompts on slots 0-2, then decode slots 0 and 2 (scattered) for one step."""
    from miles.engines.local.sampling import SamplingParams
    from miles.engines.local.scheduler import Batch, BatchRow, Request

    params = SamplingParams(max_new_tokens=4)
    reqs = [Request(f"r{i}", list(range(3, 8 + 3 * i)), params) for i in range(3)]
    prefill = [BatchRow(r, i, 0, r.input_ids, True) for i, r in enumerate(reqs)]
    runner.forward(Batch(prefill, [], 3))
    decode = Batch([BatchRow(reqs[i], i, len(reqs[i].input_ids), [9 + i], True) for i in (0, 2)], [], 3)
    return runner.forward(decode), runner._pack(decode).groups


@needs_compiler
def test_runner_decodes_by_the_kernel_on_one_thread_and_matches_the_matmul_path():
    model = _qwen3()
    with_kernel = make_runner(model, num_slots=3, capacity=32, decode_kernel=True)
    without = make_runner(model, num_slots=3, capacity=32)
    assert isinstance(with_kernel, PoolRunner) and isinstance(without, PoolRunner)
    assert with_kernel.decode_attention is not None and without.decode_attention is None
    logits, groups = _decode_logits(with_kernel)
    ref, ref_groups = _decode_logits(without)
    assert groups[0].lengths is not None and groups[0].mask is None
    assert ref_groups[0].lengths is None and ref_groups[0].mask is not None
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_runner_uses_the_matmul_path_above_the_kernels_thread_count():
    runner = make_runner(_qwen3(), num_slots=3, capacity=32, decode_kernel=True)
    assert isinstance(runner, PoolRunner) and runner.decode_attention is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_attention.MAX_THREADS + 1)
    try:
        _, groups = _decode_logits(runner)
    finally:
        torch.set_num_threads(threads)
    assert groups[0].lengths is None and groups[0].mask is not None


def test_no_kernel_for_a_head_dim_off_the_vector_width(caplog):
    with caplog.at_level(logging.WARNING):
        runner = make_runner(
            _qwen3(num_heads=2, kv_heads=1, head_dim=12), num_slots=2, capacity=16, decode_kernel=True
        )
    assert isinstance(runner, PoolRunner) and runner.decode_attention is None
    assert "head dim 12 is not a multiple of 8" in caplog.text


def test_compiler_failure_is_a_warning_and_the_matmul_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    cpu_attention.load_decode_attention.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_attention.load_decode_attention(2, 2, 8) is None
        assert "failed (exit 1)" in caplog.text and "decode attention runs as matmuls" in caplog.text
        assert list(tmp_path.iterdir()) == []  # nothing half-written left in the cache
        monkeypatch.setattr(cpu_attention.shutil, "which", lambda name: None)
        with pytest.raises(cpu_attention._Unavailable, match=r"no C compiler: set \$CC"):
            cpu_attention._load(2, 2, 8)
    finally:
        cpu_attention.load_decode_attention.cache_clear()


@needs_compiler
def test_compiled_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path))
    first = cpu_attention._load(1, 2, 16)
    assert first.path.parent == tmp_path and first.path.exists()

    def no_compile(*args):
        raise AssertionError("compiled again although the cache holds the library")

    monkeypatch.setattr(cpu_attention, "_compile", no_compile)
    again = cpu_attention._load(1, 2, 16)
    assert again.path == first.path
    other_shape = tmp_path / "other"
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(other_shape))
    with pytest.raises(AssertionError, match="compiled again"):
        cpu_attention._load(1, 2, 16)


def test_engine_flag_turns_the_kernel_off():
    assert parse_args(["--model-path", "m"]).cpu_decode_kernel is True
    assert parse_args(["--model-path", "m", "--no-cpu-decode-kernel"]).cpu_decode_kernel is False
