"""The FSDP trainer's step against a plain HF forward/backward/AdamW on the same tokens (issue 10).

    python scripts/bench/train_step.py [--workload compute] [--ranks 2] [--steps 3] [--warmup 1]
    python scripts/bench/train_step.py --code /work/main --code . --repeats 2   # A/B two checkouts, interleaved
    python scripts/bench/train_step.py --profile /tmp/miles.raw                  # py-spy rank 0 of the last run

The workload's model (`bench_workloads.build_model`) and a synthetic rollout batch of its shape (samples per step,
prompts of ~10 tokens, responses of exactly `max_response_len` tokens, GRPO rewards varying within each group).

- ``miles``: `--ranks` processes, each an `FSDPTrainer` (one gloo group, as `miles.train` runs it: the actor's
  `init` + `train` with the flags `vs_trl.py` passes), timed per `train()` call; one run per `--code` checkout
  (the children import `miles` from there), runs interleaved over `--repeats`.
- ``hf``: one process with all cores, the HF model in train mode, micro-batches of `micro_batch_size` right-padded
  samples (SDPA, attention mask), log-softmax of the response logits, a GRPO-shaped loss, backward, grad clip,
  fused AdamW (TRL's default): the floor a plain trainer such as TRL pays for the same tokens.

Prints median seconds per step after `--warmup` steps per system and the ratio miles / hf.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_workloads import WORKLOADS, Workload, build_model, get_workload  # noqa: E402

PROMPT_LEN = (8, 12)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="compute", choices=sorted(WORKLOADS))
    p.add_argument(
        "--ranks", type=int, default=2, help="miles training ranks (the cores are split between them)"
    )
    p.add_argument("--steps", type=int, default=3, help="timed train steps per run, after --warmup")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per run")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the systems")
    p.add_argument(
        "--code",
        action="append",
        default=None,
        help="checkout whose `miles` the miles runs import (repeatable: A/B; default: this one)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the plain HF floor")
    p.add_argument("--profile", default=None, help="py-spy raw profile of miles rank 0 in the last run")
    p.add_argument(
        "--torch-profile", action="store_true", help="torch.profiler table of miles rank 0's last step"
    )
    p.add_argument("--model-dir", default=None, help="reuse this built model (built there when missing)")
    p.add_argument("--child", choices=("miles", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("ranks", "steps", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    return a


# ------------------------------------------------------------------------------------------------ data
def synthetic_batch(w: Workload, vocab: int, seed: int) -> list[dict]:
    """One step's samples: prompt ~10 tokens, response exactly `max_response_len`, groups of `n_samples`."""
    rng = random.Random(seed)
    out = []
    for g in range(w.n_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_LEN))]
        for _ in range(w.n_samples):
            response = [rng.randrange(3, vocab) for _ in range(w.max_response_len)]
            out.append({"group": g, "tokens": prompt + response, "response_length": len(response),
                        "reward": float(rng.random() < 0.5)})  # fmt: skip
    return out


def _vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


# ------------------------------------------------------------------------------------------------ children
def miles_trainer(model_dir: str, w: Workload, rank: int, world: int, extra: Sequence[str] = ()):
    """Rank `rank` of `world` as `miles.train` runs it: an initialised `FSDPTrainer` with the flags `vs_trl.py`
    passes and `extra` (one gloo group; RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    argv = ["--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "100",
            "--rollout-batch-size", str(w.n_prompts), "--n-samples-per-prompt", str(w.n_samples),
            "--rollout-max-response-len", str(w.max_response_len), "--rollout-temperature", "1.0",
            "--global-batch-size", str(w.samples_per_step), "--micro-batch-size", str(w.micro_batch_size),
            "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
            "--optimizer", "adam", "--lr", str(w.lr), "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(world), "--colocate",
            "--train-backend", "fsdp", "--run-dir", tempfile.mkdtemp(prefix="train-step-"), "--seed", "1", *extra]  # fmt: skip
    trainer = FSDPTrainer(parse_config(argv), rank, world)
    trainer.init("actor", with_ref=False)
    return trainer


def rank_samples(w: Workload, model_dir: str, step: int, rank: int, world: int) -> list:
    """Rank `rank`'s share of step `step`'s synthetic batch (the driver's round-robin split), as `Sample`s."""
    from miles.utils.types import Sample, SampleStatus

    rows = synthetic_batch(w, _vocab(model_dir), seed=step)
    mine = [r for i, r in enumerate(rows) if i % world == rank]
    return [Sample(index=i, group_index=r["group"], tokens=r["tokens"], response_length=r["response_length"],
                   loss_mask=[1] * r["response_length"], reward=r["reward"], status=SampleStatus.COMPLETED)
            for i, r in enumerate(mine)]  # fmt: skip


def miles_child(a: argparse.Namespace, w: Workload) -> None:
    import torch

    trainer = miles_trainer(a.model_dir, w, a.rank, a.ranks)
    times, cpu = [], []
    for step in range(a.warmup + a.steps):
        samples = rank_samples(w, a.model_dir, step, a.rank, a.ranks)
        last = step == a.warmup + a.steps - 1
        prof = torch.profiler.profile() if a.torch_profile and last else contextlib.nullcontext()
        t0, c0 = time.perf_counter(), time.process_time()
        with prof:
            trainer.train(step, samples)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if a.torch_profile and last and a.rank == 0:
            table = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
            )
            print(table, file=sys.stderr)
        if step >= a.warmup:
            times.append(dt)
            cpu.append(dc)
    print(json.dumps({"times": times, "cpu": cpu, "threads": torch.get_num_threads()}), flush=True)
    torch.distributed.destroy_process_group()  # gloo threads left running at exit can abort the process


def hf_child(a: argparse.Namespace, w: Workload) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, fused=True)  # TRL's default (adamw_torch_fused)
    vocab = _vocab(a.model_dir)
    times, cpu = [], []
    for step in range(a.warmup + a.steps):
        rows = synthetic_batch(w, vocab, seed=step)
        t0, c0 = time.perf_counter(), time.process_time()
        rewards = torch.tensor([r["reward"] for r in rows]).view(w.n_prompts, w.n_samples)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        for s in range(0, len(rows), w.micro_batch_size):
            mb = rows[s : s + w.micro_batch_size]
            longest = max(len(r["tokens"]) for r in mb)
            ids = torch.zeros(len(mb), longest, dtype=torch.long)
            mask = torch.zeros(len(mb), longest, dtype=torch.long)
            resp = torch.zeros(len(mb), longest, dtype=torch.bool)
            for i, r in enumerate(mb):  # left padding, as generate() output is
                n, rl = len(r["tokens"]), r["response_length"]
                ids[i, longest - n :] = torch.tensor(r["tokens"])
                mask[i, longest - n :] = 1
                resp[i, longest - rl :] = True
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            m = resp[:, 1:].float()
            ratio = torch.exp(logp - logp.detach())
            per_tok = -ratio * adv[s : s + len(mb), None]
            loss = ((per_tok * m).sum(1) / m.sum(1)).sum() / len(rows)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    print(json.dumps({"times": times, "cpu": cpu, "threads": torch.get_num_threads()}))


# ------------------------------------------------------------------------------------------------ driver
def run_miles(a: argparse.Namespace, code: str, profile: str | None) -> dict:
    from miles.utils.net import free_port

    port = str(free_port())
    procs = []
    for rank in range(a.ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(a.ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PYTHONPATH": code}  # fmt: skip
        cmd = [sys.executable, __file__, "--child", "miles", "--rank", str(rank), "--model-dir", a.model_dir,
               "--workload", a.workload, "--ranks", str(a.ranks), "--steps", str(a.steps),
               "--warmup", str(a.warmup)] + (["--torch-profile"] if a.torch_profile else [])  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    spy = None
    if profile:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(procs[0].pid), "-r", "100", "--format", "raw",
                                "-o", profile, "--nonblocking", "--subprocesses"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    outs = [p.communicate(timeout=1800) for p in procs]
    if spy is not None:
        spy.wait(timeout=60)
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"miles rank {rank} ({code}) failed:\n{err[-4000:]}")
    if a.torch_profile:
        table = outs[0][1]
        print(table[table.find("-----") :], flush=True)
    ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    # wall time: rank 0's (the ranks meet in collectives every step); CPU time: all ranks' together
    return {**ranks[0], "cpu": [sum(c) for c in zip(*(r["cpu"] for r in ranks))]}


def run_hf(a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "hf", "--model-dir", a.model_dir, "--workload", a.workload,
           "--steps", str(a.steps), "--warmup", str(a.warmup)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"hf run failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    w = get_workload(a.workload)
    if a.child:
        (miles_child if a.child == "miles" else hf_child)(a, w)
        return 0
    codes = [str(Path(c).resolve()) for c in (a.code or [str(HERE.parents[1])])]
    tmp = None
    if a.model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="train-step-model-")
        a.model_dir = tmp.name
    if not os.path.exists(os.path.join(a.model_dir, "config.json")):
        build_model(w, a.model_dir)
    walls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for rep in range(a.repeats):
        systems = [f"miles@{c}" for c in codes] + ([] if a.no_hf else ["hf"])
        for name in systems if rep % 2 == 0 else systems[::-1]:
            last = rep == a.repeats - 1 and name == f"miles@{codes[-1]}"
            r = run_hf(a) if name == "hf" else run_miles(a, name[6:], a.profile if last else None)
            walls.setdefault(name, []).extend(r["times"])
            cpus.setdefault(name, []).extend(r["cpu"])
            print(f"{name}: wall {' '.join(f'{t:.2f}' for t in r['times'])} s, CPU {' '.join(f'{t:.2f}' for t in r['cpu'])} s "
                  f"({r['threads']} threads/process)", flush=True)  # fmt: skip
    print(f"workload {w.name}: {w.samples_per_step} samples/step, micro-batch {w.micro_batch_size}, "
          f"miles ranks {a.ranks}; medians per step (CPU: all processes' CPU seconds, robust to other load)")  # fmt: skip
    for label, results in (("wall", walls), ("CPU", cpus)):
        med = {k: statistics.median(v) for k, v in results.items()}
        for name, m in med.items():
            ratio = f"  ({m / med['hf']:.2f}x hf)" if "hf" in med and name != "hf" else ""
            print(f"  {label:<4} {name:<40} {m:7.3f} s{ratio}")
        if len(codes) == 2:
            print(f"  {label:<4} second / first: {med[f'miles@{codes[1]}'] / med[f'miles@{codes[0]}']:.3f}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
