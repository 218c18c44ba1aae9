"""`python -m miles.tools.gpu_check [--device cuda|cpu] [--preset 0.6b] ...`: run the GPU checks, print a report,
exit 1 when a check fails (2 for a usage or environment problem). See the package docstring."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import asdict
from pathlib import Path

CHECKS = ("train", "varlen", "refit")
NEEDED = ("torch", "transformers", "safetensors", "tokenizers", "fastapi", "uvicorn", "httpx")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; sizes left at 0 take the preset's defaults (GPU: 0.6b, CPU: tiny)."""
    p = argparse.ArgumentParser(prog="python -m miles.tools.gpu_check", description=__doc__)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the same checks, fp32")
    p.add_argument(
        "--preset", default=None, help="model shape: tiny, small, 0.6b, 1.7b (default: 0.6b, CPU: tiny)"
    )
    p.add_argument(
        "--dtype", default="auto", choices=("auto", "bfloat16", "float32"), help="auto: bf16 on GPU"
    )
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {CHECKS}")
    p.add_argument(
        "--num-seqs", type=int, default=0, help="training samples per step (even; default 16, CPU 4)"
    )
    p.add_argument(
        "--seq-len", type=int, default=0, help="tokens of the longest sample (default 1024, CPU 32)"
    )
    p.add_argument("--max-tokens-per-mb", type=int, default=0, help="packed micro-batch budget (default 4x)")
    p.add_argument("--gen-prompts", type=int, default=8, help="prompts of the generation check")
    p.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--bucket-mb", type=int, default=512, help="refit bucket size, MiB")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="GPU bf16 peak for MFU (default: known GPUs)"
    )
    p.add_argument(
        "--workdir", default=None, help="where the models are written (default: a temp dir, removed)"
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--eager", action="store_true", help="train with HF's eager elementwise ops (--no-fused-elementwise)"
    )
    p.add_argument(
        "--profile",
        default=None,
        help="torch-profile the timed train step: top ops printed, table written here",
    )
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.preset = args.preset or ("0.6b" if gpu else "tiny")
    args.num_seqs = args.num_seqs or (16 if gpu else 4)
    args.seq_len = args.seq_len or (1024 if gpu else 32)
    args.max_tokens_per_mb = args.max_tokens_per_mb or 4 * args.seq_len
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    from miles.tools.gpu_check.models import PRESETS

    errors = []
    if args.preset not in PRESETS:
        errors.append(f"--preset {args.preset!r}: allowed {sorted(PRESETS)}")
    if bad := [c for c in args.checks if c not in CHECKS]:
        errors.append(f"--checks {bad}: allowed {CHECKS}")
    if args.num_seqs < 2 or args.num_seqs % 2:
        errors.append(f"--num-seqs {args.num_seqs}: must be even and >= 2 (prompt pairs)")
    if args.seq_len < 8 or args.max_tokens_per_mb < args.seq_len:
        errors.append(
            f"--seq-len {args.seq_len} must be >= 8 and <= --max-tokens-per-mb {args.max_tokens_per_mb}"
        )
    if min(args.gen_prompts, args.gen_tokens, args.bucket_mb) < 1:
        errors.append("--gen-prompts, --gen-tokens and --bucket-mb must be >= 1")
    if errors:
        p.error("; ".join(errors))
    return args


def _missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def _environment(device) -> str:
    import torch
    import transformers

    from miles.backends.fsdp_utils.attention import torch_varlen_func

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    parts.append("torch varlen attention" + ("" if torch_varlen_func() else ": absent"))
    for mod in ("triton", "flash_attn"):
        spec = importlib.util.find_spec(mod)
        parts.append(f"{mod} {_version(mod)}" if spec else f"{mod}: not installed")
    where = (
        torch.cuda.get_device_name(device) + f", CUDA {torch.version.cuda}"
        if device.type == "cuda"
        else "CPU"
    )
    return f"{where}; " + ", ".join(parts)


def _varlen_kernel_at_hand() -> bool:
    """A CUDA varlen kernel the trainer can use: flash-attn, else torch's own (torch.nn.attention.varlen)."""
    from miles.backends.fsdp_utils.attention import torch_varlen_func

    return importlib.util.find_spec("flash_attn") is not None or torch_varlen_func() is not None


def _version(mod: str) -> str:
    try:
        return str(importlib.import_module(mod).__version__)
    except Exception as e:  # noqa: BLE001 - an installed but broken package is reported, not fatal
        return f"(import fails: {type(e).__name__})"


def _settings(args: argparse.Namespace, workdir: Path):
    import torch

    from miles.tools.gpu_check.common import Settings
    from miles.tools.gpu_check.models import PRESETS

    device = torch.device(args.device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    flash = device.type == "cuda" and _varlen_kernel_at_hand()
    return Settings(
        device=device, dtype=getattr(torch, dtype_name), preset_name=args.preset, preset=PRESETS[args.preset],
        workdir=workdir, num_seqs=args.num_seqs, seq_len=args.seq_len, max_tokens_per_mb=args.max_tokens_per_mb,
        gen_prompts=args.gen_prompts, gen_tokens=args.gen_tokens, bucket_bytes=args.bucket_mb * 1024**2,
        peak_tflops=args.peak_tflops, flash=flash, profile=Path(args.profile) if args.profile else None,
        fused=not args.eager,
    )  # fmt: skip


def run_checks(s, checks: list[str]) -> list:
    """Build the trainer's checkpoint and start the trainer (and the engine for `refit`), run `checks`; a check that
    raises is a failed result naming the exception."""
    from miles.tools.gpu_check import train
    from miles.tools.gpu_check.common import CheckResult
    from miles.tools.gpu_check.models import build_checkpoint

    results: list[CheckResult] = []

    def attempt(name: str, fn) -> bool:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - reported as the check's failure; the other checks still run
            results.append(CheckResult(name, False, f"raised {type(e).__name__}: {e}"))
            traceback.print_exc()
            return False
        results.extend(out if isinstance(out, list) else [out])
        return True

    trainer = None

    def setup() -> list:
        nonlocal trainer
        trainer_dir = build_checkpoint(s.workdir / "trainer-model", s.preset, s.seed, s.dtype, s.device)
        trainer = train.start_trainer(s, str(trainer_dir))
        return []

    if not attempt("setup", setup):
        return results
    assert trainer is not None  # set by a setup that succeeded
    ready = trainer
    if "train" in checks:
        attempt("train step", lambda: train.check_train_step(ready, s))
    if "varlen" in checks:
        attempt("varlen", lambda: train.check_varlen(ready, s))
    if "refit" in checks:
        attempt("refit", lambda: _refit_and_generate(ready, s, build_checkpoint))
    return results


def _refit_and_generate(trainer, s, build_checkpoint) -> list:
    """Refit and generation are reported separately: a generation failure still leaves the refit's numbers."""
    from miles.tools.gpu_check import refit
    from miles.tools.gpu_check.common import CheckResult

    engine_dir = build_checkpoint(s.workdir / "engine-model", s.preset, s.seed + 1, s.dtype, s.device)
    engine = refit.launch_engine(s, str(engine_dir))

    def failed(name: str, e: Exception) -> CheckResult:
        traceback.print_exc()
        tail = engine.log_tail(1500).strip().replace("\n", "\n    ")
        return CheckResult(name, False, f"raised {type(e).__name__}: {e}\n  engine log tail:\n    {tail}")

    try:
        try:
            before = refit.generate_and_compare(trainer, engine.url, s)
        except Exception as e:  # noqa: BLE001 - the refit is still checked
            before, gen_error = None, failed("generation", e)
        try:
            results = [refit.check_refit(trainer, engine.url, s)]
        except Exception as e:  # noqa: BLE001 - reported as this check's failure
            return [failed("refit", e)]
        if before is None:
            return [*results, gen_error]
        try:
            after = refit.generate_and_compare(trainer, engine.url, s)
        except Exception as e:  # noqa: BLE001 - reported as this check's failure
            return [*results, failed("generation", e)]
        return [*results, refit.check_generation(before, after, s)]
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run the checks; returns the exit code (0 all passed, 1 a check failed, 2 cannot run here)."""
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: a CPU run stays on CPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if missing := _missing_modules():
        print(f"gpu-check: cannot run, missing Python packages: {missing} (pip install {' '.join(missing)})")
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: --device cuda but torch sees no CUDA device (use --device cpu for the CPU variant)")
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="miles-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    s = _settings(args, workdir)
    print(f"miles gpu-check: {_environment(s.device)}", flush=True)
    p = s.preset
    print(f"model: Qwen3 preset {s.preset_name} (hidden {p.hidden_size}, {p.num_layers} layers, vocab "
          f"{p.vocab_size}), random weights, {s.dtype_name}; workdir {workdir}", flush=True)  # fmt: skip
    try:
        results = run_checks(s, args.checks)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for r in results:
        print(f"[{'PASS' if r.passed else 'FAIL'}] {r.name:<10} {r.summary}")
    if args.json:
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump({"device": str(s.device), "dtype": s.dtype_name, "preset": s.preset_name,
                       "results": [asdict(r) for r in results]}, f, indent=2)  # fmt: skip
        os.replace(tmp, args.json)
    failed = [r.name for r in results if not r.passed]
    if failed:
        print(f"gpu-check: FAILED {len(failed)} of {len(results)} checks: {', '.join(failed)}")
        return 1
    print(f"gpu-check: all {len(results)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
