"""Peak trainer memory: LoRA (--lora-rank) against full fine-tuning, same model, same synthetic rollout.

    python scripts/bench/lora_memory.py                       # ~25M-parameter Qwen3, 3 train steps each
    python scripts/bench/lora_memory.py --hidden 512 --layers 8 --lora-rank 16

Each mode runs in its own process (one FSDP2 rank, gloo on CPU or NCCL on a GPU) so its peaks are its own: peak
RSS on CPU (VmHWM, restarted after init), `torch.cuda.max_memory_allocated` on a GPU. Prints each mode's peak
during init (loading and sharding the model: the same work in both modes) and during training, the trainable
parameter counts and the ratios LoRA / full; nothing is asserted (the numbers depend on the model shape, the
rank and the batch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=384, help="hidden size of the random Qwen3 model")
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--samples", type=int, default=16, help="samples per rollout (one optimizer step)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample (half prompt, half response)")
    p.add_argument("--steps", type=int, default=3, help="train calls per mode")
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=1 << 20,
        help="CPU: glibc MALLOC_MMAP_THRESHOLD_ of the runs (bytes; 0: glibc's default, a growing threshold)",
    )
    p.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("hidden", "layers", "vocab", "lora_rank", "samples", "seq_len", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.malloc_mmap_threshold < 0:
        p.error("--malloc-mmap-threshold must be >= 0")
    if a.hidden % 64:
        p.error("--hidden must be a multiple of 64 (head_dim 64)")
    return a


def build_model(path: str, a: argparse.Namespace) -> int:
    """A random Qwen3 of the requested shape written to `path`; returns its parameter count."""
    from miles.tools.tiny_model import tiny_config, tiny_model

    heads = a.hidden // 64
    cfg = tiny_config(
        a.vocab,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        head_dim=64,
        intermediate_size=4 * a.hidden,
        max_position_embeddings=max(512, a.seq_len),
        tie_word_embeddings=False,
    )
    model = tiny_model(cfg, seed=0)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _samples(a: argparse.Namespace) -> list:
    from miles.utils.types import Sample, SampleStatus

    rng = random.Random(0)
    half = a.seq_len // 2
    out = []
    for i in range(a.samples):
        tokens = [rng.randrange(1, a.vocab) for _ in range(a.seq_len)]
        out.append(Sample(index=i, group_index=i // 4, tokens=tokens, response_length=a.seq_len - half,
                          loss_mask=[1] * (a.seq_len - half), reward=float(rng.random() < 0.5),
                          status=SampleStatus.COMPLETED))  # fmt: skip
    return out


def _status_gb(field: str) -> float:
    """A memory field of /proc/self/status (VmHWM: the resident high-water mark, VmRSS: resident now), GiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib / 1024**2


def _rss_peak_gb() -> float:
    return _status_gb("VmHWM")


def _reset_rss_peak() -> None:
    """Restart VmHWM from the current RSS (Linux: writing 5 to clear_refs), so the next peak is one phase's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(a: argparse.Namespace) -> None:
    import torch

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    argv = ["--hf-checkpoint", a.model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", str(a.steps),
            "--rollout-batch-size", str(a.samples // 4), "--n-samples-per-prompt", "4",
            "--global-batch-size", str(a.samples), "--micro-batch-size", "4", "--lr", "1e-4", "--colocate",
            "--run-dir", tempfile.mkdtemp(prefix="lora-bench-")]  # fmt: skip
    if a.child == "lora":
        argv += ["--lora-rank", str(a.lora_rank), "--lora-alpha", str(2 * a.lora_rank)]
    cuda = torch.cuda.is_available()
    trainer = FSDPTrainer(parse_config(argv), 0, 1)
    trainer.init("actor", with_ref=False)
    # the peak of init (loading the HF model, sharding, broadcasting it) is apart from the training peak: both
    # modes load the same full model, and a process-lifetime high-water mark would hide what training adds
    init_peak = torch.cuda.max_memory_allocated() / 1024**3 if cuda else _rss_peak_gb()
    after_init = torch.cuda.memory_allocated() / 1024**3 if cuda else _status_gb("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_rss_peak()
    for step in range(a.steps):
        trainer.train(step, _samples(a))
    train_peak = torch.cuda.max_memory_allocated() / 1024**3 if cuda else _rss_peak_gb()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    states = sum(
        t.numel() for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    print(json.dumps({"init_peak_gb": init_peak, "after_init_gb": after_init, "train_peak_gb": train_peak,
                      "device": "cuda" if cuda else "cpu", "trainable": trainable,
                      "optimizer_state_numel": states}))  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode: str, model_dir: str, argv: list[str], a: argparse.Namespace) -> dict:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
    if a.malloc_mmap_threshold:
        # glibc serves blocks above this from mmap and unmaps them on free; by default its threshold grows to
        # 32 MiB, so freed activations stay in the heap and RSS shows the allocator's high-water mark
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.malloc_mmap_threshold)
    cmd = [sys.executable, __file__, *argv, "--child", mode, "--model-dir", model_dir]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.child:
        child(a)
        return 0
    with tempfile.TemporaryDirectory(prefix="lora-bench-model-") as model_dir:
        n = build_model(model_dir, a)
        print(f"model: random Qwen3, {n / 1e6:.1f}M parameters (hidden {a.hidden}, {a.layers} layers)")
        full = run_mode("full", model_dir, argv, a)
        lora = run_mode("lora", model_dir, argv, a)
    unit = "GPU max allocated" if full["device"] == "cuda" else "peak RSS"
    for name, r in (("full fine-tuning", full), (f"LoRA rank {a.lora_rank}", lora)):
        print(f"{name:>18}: {unit} init {r['init_peak_gb']:.3f} GiB, after init {r['after_init_gb']:.3f} GiB, "
              f"training {r['train_peak_gb']:.3f} GiB (+{r['train_peak_gb'] - r['after_init_gb']:.3f}); "
              f"trainable {r['trainable'] / 1e6:.2f}M, optimizer state {r['optimizer_state_numel'] / 1e6:.2f}M values")  # fmt: skip
    for phase in ("init", "train"):
        key = f"{phase}_peak_gb"
        print(f"ratio LoRA / full ({unit}, {phase}): {lora[key] / full[key]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
