"""Checks 1 and 3: an FSDP2 train step of miles's trainer, and the packed varlen forward against per-sequence
forwards. The trainer is miles's own `FSDPTrainer` in one process (world size 1, a local process group)."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import math
import os
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from miles.tools.gpu_check.common import CheckResult, Settings, sync, training_samples
from miles.utils.net import free_port

if TYPE_CHECKING:
    from miles.backends.fsdp_utils.actor import FSDPTrainer


def start_trainer(s: Settings, model_dir: str) -> FSDPTrainer:
    """miles's FSDP2 trainer on `model_dir`, initialised in this process as rank 0 of 1 (nccl on CUDA, gloo on
    CPU), in the check's dtype, with packed (dynamic) micro-batches of `max_tokens_per_mb` tokens."""
    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ[key] = value
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    # miles_varlen: flash-attn's varlen kernel, else torch's (s.flash says one is there), SDPA on CPU
    attn = "miles_varlen" if s.flash else "sdpa"
    pairs = s.num_seqs // 2
    cfg = parse_config([
        "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "2",
        "--rollout-batch-size", str(pairs), "--n-samples-per-prompt", "2", "--global-batch-size", str(s.num_seqs),
        "--actor-num-gpus-per-node", "1", "--colocate", "--train-dtype", s.dtype_name, "--attn-implementation", attn,
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(s.max_tokens_per_mb),
        "--rollout-temperature", str(s.temperature), "--lr", "1e-5", "--seed", str(s.seed),
        "--run-dir", str(s.workdir / "run"), *([] if s.fused else ["--no-fused-elementwise"]),
    ])  # fmt: skip
    trainer = FSDPTrainer(cfg, 0, 1)
    trainer.init("actor", with_ref=False)
    return trainer


def check_train_step(trainer: FSDPTrainer, s: Settings) -> CheckResult:
    """Two train calls on synthetic samples (the first warms up); the second is timed. Passes when loss and
    gradient norm are finite."""
    from miles.utils import perf

    samples = training_samples(s)
    seq_lens = [len(x.tokens) for x in samples]
    tokens = sum(seq_lens)
    first = trainer.train(0, samples)
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    sync(s.device)
    t0 = time.perf_counter()
    metrics = trainer.train(1, samples)
    sync(s.device)
    seconds = time.perf_counter() - t0
    if s.profile is not None:
        profile_step(trainer, samples, s)
    loss, grad_norm = float(metrics["train/loss"]), float(metrics["train/grad_norm"])
    # forward-equivalents the trainer ran (forward + backward = 3, plus the no-grad passes it did not skip)
    flops = perf.model_forward_flops(trainer.model, seq_lens) * metrics["perf/forward_passes"]
    peak = s.peak_tflops * 1e12 if s.peak_tflops else None
    if peak is None and s.device.type == "cuda":
        peak = perf.peak_flops(torch.cuda.get_device_name(s.device))
    mfu = perf.mfu(flops, seconds, 1, peak) if peak else None
    mem = torch.cuda.max_memory_allocated(s.device) / 1024**3 if s.device.type == "cuda" else None
    numbers = {
        "loss": loss,
        "grad_norm": grad_norm,
        "first_step_loss": float(first["train/loss"]),
        "first_mb_ppo_kl_abs_max": float(metrics["train/first_mb_ppo_kl_abs_max"]),
        "step_seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": mfu,
        "peak_gpu_mem_gib": mem,
    }
    passed = math.isfinite(loss) and math.isfinite(grad_norm)
    mfu_text = f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a (unknown peak: --peak-tflops)"
    mem_text = f", peak mem {mem:.1f} GiB" if mem is not None else ""
    summary = (
        f"loss {loss:.4g} ({'finite' if passed else 'NOT finite'}), grad norm {grad_norm:.3g}, "
        f"{len(samples)} samples / {tokens} tokens in {seconds:.3f} s: {tokens / seconds:,.0f} tokens/s, "
        f"{flops / seconds / 1e12:.3g} TFLOP/s, {mfu_text}{mem_text}; "
        f"first micro-batch |new - old log-prob| {numbers['first_mb_ppo_kl_abs_max']:.3g}"
    )
    return CheckResult("train step", passed, summary, numbers)


@contextlib.contextmanager
def _host_syncs(device: torch.device) -> Iterator[collections.Counter[str]]:
    """Count the step's device -> host synchronisations (each stalls the launch queue) by Python call site, with
    torch's CUDA sync debug mode; an empty counter on CPU."""
    counts: collections.Counter[str] = collections.Counter()
    if device.type != "cuda":
        yield counts
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{w.filename}:{w.lineno}"] += 1


def profile_step(trainer: FSDPTrainer, samples: list, s: Settings, rows: int = 30) -> None:
    """One more train call under torch.profiler (after the timed one, so the numbers above are unprofiled): the
    top `rows` ops by self device time (CPU time on CPU) printed and the full table written to `s.profile`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
    with profile(activities=activities) as prof, _host_syncs(s.device) as syncs:
        trainer.train(2, samples)
        sync(s.device)
    if syncs:
        print(f"device -> host synchronisations in the profiled step: {sum(syncs.values())}; top call sites:")
        for where, count in syncs.most_common(15):
            print(f"  {count:6d}  {where}")
    averages = prof.key_averages()
    key = "self_cpu_time_total"
    if s.device.type == "cuda":
        key = (
            "self_device_time_total"
            if hasattr(averages[0], "self_device_time_total")
            else "self_cuda_time_total"
        )
    table = averages.table(sort_by=key, row_limit=rows)
    print(table, flush=True)
    assert s.profile is not None
    s.profile.parent.mkdir(parents=True, exist_ok=True)
    s.profile.write_text(averages.table(sort_by=key, row_limit=200))


@torch.no_grad()
def check_varlen(trainer: FSDPTrainer, s: Settings) -> CheckResult:
    """The trainer's packed forward (`miles_varlen` attention, the kernel training uses) over several sequences
    against a plain HF forward (`sdpa`) of each sequence alone: max |Δ log-prob| over every predicted token."""
    from miles.algo.logprobs import compute_log_probs
    from miles.backends.fsdp_utils.attention import use_flash_kernel
    from miles.backends.fsdp_utils.data_packing import pack_sequences
    from miles.backends.fsdp_utils.forward import forward_packed

    model = trainer.model
    rows, budget = [], s.max_tokens_per_mb
    for sample in training_samples(s):
        if len(sample.tokens) <= budget:
            rows.append({"tokens": sample.tokens, "response_length": len(sample.tokens) - 1})
            budget -= len(sample.tokens)
    (packed,) = pack_sequences(rows, num_packs=1)
    packed_lp, _ = forward_packed(model, packed, 1.0)
    probe = torch.empty(1, device=s.device)
    kernel = "per-sequence SDPA"
    if use_flash_kernel(probe):
        kernel = "flash-attn varlen" if importlib.util.find_spec("flash_attn") else "torch varlen"
    model.set_attn_implementation("sdpa")  # forward_packed switches it back
    worst, total, count = 0.0, 0.0, 0
    for lp, index in zip(packed_lp, packed.sample_indices.tolist()):
        ids = torch.tensor(rows[index]["tokens"], device=s.device)
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
        diff = (lp - compute_log_probs(logits, ids[1:], 1.0)).abs()
        worst, total, count = max(worst, float(diff.max())), total + float(diff.sum()), count + diff.numel()
    tol = s.tolerances.varlen_max
    numbers: dict[str, float | int | str | None] = {"sequences": len(rows), "tokens": packed.num_tokens, "max_abs_diff": worst,
               "mean_abs_diff": total / count, "tolerance": tol, "kernel": kernel}  # fmt: skip
    passed = worst <= tol
    summary = (
        f"{len(rows)} sequences / {packed.num_tokens} tokens packed ({kernel}, {s.dtype_name}) vs per-sequence "
        f"sdpa forwards: max |Δ log-prob| {worst:.3g} (tolerance {tol:g}), mean {total / count:.3g}"
    )
    return CheckResult("varlen", passed, summary, numbers)
