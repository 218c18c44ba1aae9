"""Embedded engine vs `model.generate` (CPU or one GPU): generated tokens/s, side by side in one run.

    flock /tmp/miles-heavy.lock python scripts/bench/engine.py [--models tiny,25m] [--batch-sizes 1,8,64]
        [--new-tokens 64] [--num-threads 1] [--repeats 3] [--modes inproc,http] [--baseline-src DIR]
        [--device cpu|cuda|cuda:N]

Same model weights, same prompts (8-24 random tokens each), same sampling (temperature 1, no top-k/top-p, no
stop: `ignore_eos` for the engine, `eos_token_id=None` for `generate`), same torch intra-op threads. Each
measurement is one call that generates `--new-tokens` tokens for every prompt of the batch, prefill included;
tokens/s = batch * new tokens / wall seconds. Repeats are interleaved (generate, in-process engine, HTTP engine,
then again), the median is reported with the ratio engine / generate and the spread (slowest and fastest
repeat). The engine returns log-probs
(`return_logprob`, as in RL); `generate` does not compute them. `--baseline-src DIR` adds the embedded engine of
another source tree (e.g. `git archive main | tar -x -C DIR`) over HTTP, side `base-http`: before/after numbers
in one run.

Models (random weights, built locally in a temp dir): `tiny` is `miles.tools.tiny_model`'s default (hidden 64,
2 layers, 4 heads: the quickstart workload's shape); `25m` is Qwen3-shaped with hidden 512, 8 layers, 8 heads
(4 KV heads), MLP 1536 and the same 48-token vocabulary (the compute workload's shape). `--model-path DIR`
benchmarks an existing HF model.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODELS = {
    "tiny": {},
    "25m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1536},
}


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=_csv(str), default=["tiny", "25m"], help=f"built models: {list(MODELS)}")
    p.add_argument("--model-path", default=None, help="benchmark this HF model directory instead of --models")
    p.add_argument("--batch-sizes", type=_csv(int), default=[1, 8, 64])
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads, both sides")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is reported")
    p.add_argument("--modes", type=_csv(str), default=["inproc", "http"], help="engine modes: inproc, http")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where both sides run: cpu, cuda, cuda:N (fp32)")
    p.add_argument(
        "--baseline-src", default=None, help="also run the embedded engine of this source tree over HTTP"
    )
    a = p.parse_args(argv)
    bad = [m for m in a.models if m not in MODELS]
    if bad and a.model_path is None:
        p.error(f"--models {bad} unknown; allowed: {list(MODELS)}")
    bad = [m for m in a.modes if m not in ("inproc", "http")]
    if bad:
        p.error(f"--modes {bad} unknown; allowed: inproc, http")
    if a.new_tokens < 1 or a.repeats < 1 or a.num_threads < 1 or min(a.batch_sizes) < 1:
        p.error("--new-tokens, --repeats, --num-threads and --batch-sizes must be >= 1")
    if (
        a.device != "cpu"
        and a.device != "cuda"
        and not (a.device.startswith("cuda:") and a.device[5:].isdigit())
    ):
        p.error(f"--device {a.device!r}: allowed cpu, cuda, cuda:N")
    if a.baseline_src is not None and not (Path(a.baseline_src) / "miles" / "engines" / "local").is_dir():
        p.error(
            f"--baseline-src {a.baseline_src}: no miles/engines/local there (expected a miles source tree)"
        )
    return a


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of 8-24 tokens drawn from ids 3..vocab-1 (past the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))] for _ in range(n)]


class HFGenerate:
    """`model.generate` with left padding; sampling at temperature 1, no filters, no stop."""

    def __init__(self, path: str, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.torch = torch
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        self.pad = self.model.config.pad_token_id or 0
        # no stop token at all (the model's own generation config would otherwise add its EOS back)
        self.model.generation_config.eos_token_id = None
        self.config_cls = GenerationConfig
        self.sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> int:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=self.config_cls(
                    **self.sampling, eos_token_id=None, pad_token_id=self.pad, max_new_tokens=new_tokens
                ),
            )
        out = out.cpu()  # the tokens on the host, as the engine returns them (waits for the device)
        generated = out.shape[1] - width
        assert generated == new_tokens, f"generate stopped after {generated} of {new_tokens} tokens"
        return out.shape[0] * generated


def _engine_body(prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    sp = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    return {
        "input_ids": prompts,
        "sampling_params": sp,
        "return_logprob": True,
        "rid": [f"{tag}-{i}" for i in range(len(prompts))],
    }


def _count(outs: list[dict], new_tokens: int) -> int:
    lens = [len(o["output_ids"]) for o in outs]
    assert all(n == new_tokens for n in lens), f"engine returned lengths {sorted(set(lens))}"
    return sum(lens)


class InProcEngine:
    """`LocalEngine` in this process (no HTTP)."""

    def __init__(self, path: str, max_running: int, device: str = "cpu"):
        from miles.engines.local.engine import LocalEngine, LocalEngineConfig

        cfg = LocalEngineConfig(model_path=path, max_running_requests=max_running, device=device)
        self.engine = LocalEngine(cfg)
        self.engine.start()
        self.kv_cache = self.engine.server_info("", 0)["kv_cache"]
        self.decode_attention = self.engine.server_info("", 0)["decode_attention"]
        self.calls = 0

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> int:
        self.calls += 1
        _, futs, _ = self.engine.submit_generate(_engine_body(prompts, new_tokens, f"b{self.calls}"))
        return _count([f.result(600) for f in futs], new_tokens)

    def close(self) -> None:
        self.engine.stop()


class HTTPEngine:
    """The embedded engine as its own server process, one batched POST /generate per call; `python` runs the
    server (a wrapper that puts another source tree first on PYTHONPATH measures that tree's engine)."""

    def __init__(
        self, path: str, max_running: int, threads: int, python: str | None = None, device: str = "cpu"
    ):
        from miles.engines.sglang_engine import EngineProcess

        local_args = {"num-threads": threads, "max-running-requests": max_running, "log-level": "warning"}
        if device != "cpu":  # a baseline tree from before --device existed still runs on CPU
            local_args["device"] = device
        self.proc = EngineProcess(
            path,
            kind="local",
            local_args=local_args,
            python=python,
        ).launch()
        info = self.proc.get("/get_server_info")
        self.kv_cache = info.get("kv_cache")  # tells which engine answers
        self.decode_attention = info.get("decode_attention")  # absent from engines before the CPU kernel
        self.calls = 0

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> int:
        self.calls += 1
        outs = self.proc.post("/generate", _engine_body(prompts, new_tokens, f"h{self.calls}"), timeout=600)
        return _count(outs, new_tokens)

    def close(self) -> None:
        self.proc.shutdown()


def baseline_python(src: str, root: Path) -> str:
    """An executable that runs this interpreter on the source tree `src`: first on PYTHONPATH (EngineProcess
    prepends this checkout's root) and the working directory (`python -m` puts it before PYTHONPATH)."""
    src = str(Path(src).resolve())
    wrapper = root / "baseline-python"
    wrapper.write_text(
        f'#!/bin/sh\ncd "{src}" && PYTHONPATH="{src}:$PYTHONPATH" exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def build_model(name: str, root: Path) -> tuple[str, int]:
    """Build model `name` under `root`; returns (path, parameter count)."""
    from miles.tools.tiny_model import build_tiny_model

    path = build_tiny_model(root / name, seed=0, **MODELS[name])
    return str(path), _num_params(str(path))


def _num_params(path: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def bench_model(label: str, path: str, args: argparse.Namespace, baseline: str | None = None) -> list[tuple]:
    """Run every batch size for one model; returns result rows."""
    import torch

    torch.set_num_threads(args.num_threads)
    vocab = _vocab_size(path)
    max_running = max(args.batch_sizes)
    dev = args.device
    sides: dict[str, object] = {"generate": HFGenerate(path, dev)}
    if "inproc" in args.modes:
        sides["inproc"] = InProcEngine(path, max_running, dev)
    if "http" in args.modes:
        sides["http"] = HTTPEngine(path, max_running, args.num_threads, device=dev)
    if baseline is not None:
        sides["base-http"] = HTTPEngine(path, max_running, args.num_threads, python=baseline, device=dev)
    for name, side in sides.items():
        if isinstance(side, (HTTPEngine, InProcEngine)):
            print(
                f"{label}: side {name} reports kv_cache={side.kv_cache!r}, "
                f"decode_attention={side.decode_attention!r}",
                flush=True,
            )
    rows = []
    try:
        for bs in args.batch_sizes:
            prompts = make_prompts(bs, vocab, args.seed + bs)
            for fn in sides.values():  # warm-up: allocator, thread pools, first-call paths
                fn(prompts, min(4, args.new_tokens))
            times: dict[str, list[float]] = {k: [] for k in sides}
            tokens: dict[str, int] = {}
            for _ in range(args.repeats):
                for name, fn in sides.items():
                    t0 = time.perf_counter()
                    tokens[name] = fn(prompts, args.new_tokens)
                    times[name].append(time.perf_counter() - t0)
            rate = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
            for name in sides:
                lo, hi = tokens[name] / max(times[name]), tokens[name] / min(times[name])
                rows.append((label, bs, name, rate[name], rate[name] / rate["generate"], lo, hi))
                print(
                    f"{label:>6} batch {bs:>3} {name:>9}: {rate[name]:9.0f} tokens/s [{lo:.0f}-{hi:.0f}] "
                    f"({rate[name] / rate['generate']:.2f}x generate)",
                    flush=True,
                )
    finally:
        for fn in sides.values():
            if hasattr(fn, "close"):
                fn.close()
    return rows


def _vocab_size(path: str) -> int:
    import json

    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-engine-") as tmp:
        targets = (
            [("custom", args.model_path)]
            if args.model_path
            else [(m, build_model(m, Path(tmp))[0]) for m in args.models]
        )
        baseline = baseline_python(args.baseline_src, Path(tmp)) if args.baseline_src else None
        for label, path in targets:
            print(f"model {label}: {_num_params(path) / 1e6:.3f}M parameters ({path})", flush=True)
            rows += bench_model(label, path, args, baseline)
    print(
        f"\nsummary (device={args.device}, threads={args.num_threads}, new tokens={args.new_tokens}, "
        f"median of {args.repeats}, [slowest-fastest repeat]):"
    )
    print(f"{'model':>6} {'batch':>5} {'side':>9} {'tokens/s':>10} {'spread':>17} {'vs generate':>12}")
    for label, bs, name, rate, ratio, lo, hi in rows:
        print(f"{label:>6} {bs:>5} {name:>9} {rate:10.0f} {f'[{lo:.0f}-{hi:.0f}]':>17} {ratio:11.2f}x")


if __name__ == "__main__":
    sys.exit(main())
