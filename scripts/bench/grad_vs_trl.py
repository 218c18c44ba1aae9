"""miles' GRPO gradient against TRL's on one identical batch: same model, prompts, responses and rewards.

    python scripts/bench/grad_vs_trl.py [--workload varlen] [--trl-venv .venv-trl] [--work-dir DIR]

Sampling noise is taken out: the responses are sampled once here (`transformers.generate`, the bench's sampling
settings, cut after the first EOS as TRL cuts them), then both systems train ONE optimizer step on exactly those
responses, each through its real trainer:
- miles: `FSDPTrainer.train` on one gloo rank (or `--miles-ranks 2`), configured by `vs_trl.miles_command`'s flags,
  on `Sample` records carrying the fixed tokens and the math reward of their text;
- TRL: `GRPOTrainer.train` for one step, configured by `trl_child.grpo_config_kwargs`, with its generation replaced by
  a lookup of the fixed responses (TRL decodes them, scores them with the same reward and computes its advantages).
Each side records, per sample, the prompt/response token ids it trained on, the reward and the advantage, and the
gradient of every parameter (before clipping) and the parameter change of the step. The report compares them per
tensor (cosine, norm ratio). `--rollout FILE` trains both on a saved rollout instead (a miles
`--save-debug-rollout-data` file, or JSON lines of `prompt`, `label`, `tokens`, `response_length` records).
Run under `flock /tmp/miles-heavy.lock` on a shared machine.

What it showed on the varlen workload (issue 10): on the same batch the two gradients agree to cosine 1.000000 for
every tensor, norm ratio 1.0003 (the advantage's std epsilon: miles 1e-6, TRL 1e-4), with 1 or 2 miles ranks; fed
each other's real first rollouts, each trainer reproduces the other's step. The opposite update directions of the
two systems' real first steps came from their batches: with the per-sequence mean loss, every response's EOS and
shared per-token terms weigh 1/L_i, so the gradient carries a large component along one fixed direction whose
sign is that of sum_i A_i / L_i (are the rewarded responses shorter than their group's?). The math reward is
nearly independent of length, so that sign is a coin flip per batch (2 of 8 independent batches here); Adam's
sign-like first step moves every parameter by lr along it, enough to shorten responses from ~58 to ~28 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from bench_workloads import SHARED, Workload, build_model, get_workload, make_rows, write_rows  # noqa: E402

DEFAULT_TRL_VENV = REPO / ".venv-trl"


@dataclass
class FixedBatch:
    """One rollout's worth of fixed data: `n_prompts` prompts x `n_samples` responses, in prompt-group order."""

    prompts: list[str]  # [P] prompt text (dataset rows)
    labels: list[str]  # [P]
    prompt_ids: list[list[int]]  # [P] x [prompt_len]
    responses: list[list[int]]  # [P * S] x [response_len], sample k of prompt p at p * S + k

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------ the batch
def sample_batch(w: Workload, model_dir: Path, seed: int) -> FixedBatch:
    """`w.n_prompts` dataset rows, `w.n_samples` responses each from `transformers.generate` (temperature 1, no
    top-k/top-p, `w.max_response_len` new tokens), each cut after its first EOS (kept, as both systems train on
    it); prompts are tokenized as miles' data source does (plain text, the tokenizer's default special tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = make_rows(w, w.n_prompts, seed=0)
    if w.chat:
        raise ValueError(
            f"workload {w.name}: chat prompts are not supported here (plain-text workloads only)"
        )
    torch.manual_seed(seed)
    prompt_ids, responses = [], []
    for row in rows:
        ids = tok(row["prompt"])["input_ids"]
        prompt_ids.append(ids)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids] * w.n_samples),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=w.max_response_len,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        for seq in out[:, len(ids) :].tolist():
            responses.append(seq[: seq.index(tok.eos_token_id) + 1] if tok.eos_token_id in seq else seq)
    return FixedBatch(
        prompts=[r["prompt"] for r in rows], labels=[str(r["label"]) for r in rows], prompt_ids=prompt_ids,
        responses=responses,
    )  # fmt: skip


def batch_from_rollout(path: Path, n_samples: int) -> FixedBatch:
    """The batch of a saved rollout: a `--save-debug-rollout-data` file of miles (JSON lines after a header
    line) or any JSON-lines file of records with `prompt`, `label`, `tokens` and `response_length`, grouped by
    prompt in runs of `n_samples` consecutive records."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "tokens" in r]
    if not rows or len(rows) % n_samples:
        raise ValueError(f"{path}: {len(rows)} sample records, expected a positive multiple of {n_samples}")
    prompts, labels, prompt_ids, responses = [], [], [], []
    for start in range(0, len(rows), n_samples):
        group = rows[start : start + n_samples]
        ids = [r["tokens"][: len(r["tokens"]) - r["response_length"]] for r in group]
        if any(r["prompt"] != group[0]["prompt"] or i != ids[0] for r, i in zip(group, ids)):
            raise ValueError(f"{path}: records {start}..{start + n_samples - 1} are not one prompt's group")
        prompts.append(group[0]["prompt"])
        labels.append(str(group[0]["label"]))
        prompt_ids.append(ids[0])
        responses += [r["tokens"][len(ids[0]) :] for r in group]
    return FixedBatch(prompts=prompts, labels=labels, prompt_ids=prompt_ids, responses=responses)


# ------------------------------------------------------------------------------------------------ miles side
def miles_flags(w: Workload, model_dir: Path, data: Path, run_dir: Path, ranks: int) -> list[str]:
    """The flags `vs_trl.miles_command` gives `miles.train` for `w`, with `ranks` colocated trainers."""
    import vs_trl

    argv = vs_trl.miles_command(w, model_dir, data, run_dir, "colocate1")[3:]  # drop `python -m miles.train`
    argv[argv.index("--actor-num-gpus-per-node") + 1] = str(ranks)
    return argv


def miles_rank(rank: int, world: int, w: Workload, model_dir: Path, batch: FixedBatch, out: Path) -> None:
    """Rank `rank` of `world` (gloo, env:// rendezvous) training one `FSDPTrainer.train` step on its share of
    `batch` (whole prompt groups, as the driver splits them); rank 0 writes `out`/miles.pt, every rank its
    `out`/miles-rank{rank}.pt (the samples it saw, their rewards and advantages)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoTokenizer

    from miles.backends.fsdp_utils import actor as actor_mod
    from miles.backends.fsdp_utils import rollout_batch as rb
    from miles.backends.fsdp_utils import state as state_mod
    from miles.config import parse_config
    from miles.rollout.rm_hub.math_utils import math_reward
    from miles.utils.seqlen_balancing import partition_samples_by_dp
    from miles.utils.types import Sample, SampleStatus

    tok = AutoTokenizer.from_pretrained(model_dir)
    samples = []
    for i, resp in enumerate(batch.responses):
        p = i // w.n_samples
        # as vs_trl runs miles (bench_workloads.SHARED.skip_special_tokens: --rollout-skip-special-tokens, TRL's way)
        text = tok.decode(resp, skip_special_tokens=SHARED.skip_special_tokens)
        samples.append(
            Sample(index=i, group_index=p, prompt=batch.prompts[p], tokens=batch.prompt_ids[p] + resp,
                   response_length=len(resp), response=text, label=batch.labels[p],
                   reward=math_reward(text, batch.labels[p]), loss_mask=[1] * len(resp),
                   status=SampleStatus.COMPLETED)
        )  # fmt: skip
    parts = partition_samples_by_dp(
        [len(s.tokens) for s in samples], [s.group_index for s in samples], world, balance=False
    )
    mine = [samples[i] for i in parts[rank]]
    cfg = parse_config(miles_flags(w, model_dir, out / "unused.jsonl", out / "miles-run", world))
    trainer = actor_mod.FSDPTrainer(cfg, rank, world)
    trainer.init("actor", with_ref=False)
    before = _full_state(trainer.model, get_model_state_dict, StateDictOptions)

    seen: dict[str, object] = {}
    real_advantages, real_step = rb.compute_advantages_for, state_mod.clipped_optimizer_step

    def advantages(batch_, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - pass-through spy
        real_advantages(batch_, *args, **kwargs)
        seen["advantages"] = [float(a[0]) if a.numel() else 0.0 for a in batch_.advantages]

    def step(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - pass-through spy
        seen["grads"] = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        return real_step(model, *args, **kwargs)

    rb.compute_advantages_for, state_mod.clipped_optimizer_step = advantages, step
    try:
        metrics = trainer.train(0, mine)
    finally:
        rb.compute_advantages_for, state_mod.clipped_optimizer_step = real_advantages, real_step
    after = _full_state(trainer.model, get_model_state_dict, StateDictOptions)
    per_rank = {
        "indices": parts[rank], "rewards": [s.scalar_reward() for s in mine], "advantages": seen["advantages"],
        "tokens": [s.tokens for s in mine], "response_lengths": [s.response_length for s in mine],
    }  # fmt: skip
    torch.save(per_rank, out / f"miles-rank{rank}.pt")
    if rank == 0:
        delta = {k: after[k] - before[k] for k in before}
        torch.save({"grads": seen["grads"], "delta": delta, "metrics": metrics}, out / "miles.pt")


def _full_state(model: torch.nn.Module, get_state, options_cls) -> dict[str, torch.Tensor]:  # noqa: ANN001
    state = get_state(model, options=options_cls(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone().float() for k, v in state.items()}


# ------------------------------------------------------------------------------------------------ TRL side
def trl_side(w: Workload, model_dir: Path, batch: FixedBatch, out: Path) -> None:
    """One `GRPOTrainer.train` step on `batch` (run by the TRL venv's Python); writes `out`/trl.pt."""
    import datasets
    import trl_child
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from miles.rollout.rm_hub.math_utils import math_reward

    tok = AutoTokenizer.from_pretrained(model_dir)
    queues: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(batch.responses)):
        queues.setdefault(tuple(batch.prompt_ids[i // w.n_samples]), []).append(i)
    handed: list[int] = []  # batch index of each response TRL received, in TRL's order
    rewards: list[float] = []

    def reward_math(prompts, completions, label, **kwargs):  # noqa: ANN001, ANN003 - TRL's reward signature
        scores = [math_reward(c, lab) for c, lab in zip(completions, label)]
        rewards.extend(scores)
        return scores

    def fixed_generate(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        completions = []
        for ids in prompt_ids:
            queue = queues.get(tuple(ids))
            if not queue:
                raise ValueError(
                    f"TRL asked to complete a prompt not in the batch (or too often): ids {list(ids)}"
                )
            handed.append(queue.pop(0))
            completions.append(list(batch.responses[handed[-1]]))
        return completions, None

    scored: dict[str, torch.Tensor] = {}
    real_score = GRPOTrainer._generate_and_score_completions

    def score(self, inputs):  # noqa: ANN001 - pass-through spy
        result = real_score(self, inputs)
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
            scored[key] = result[key].detach().clone()
        return result

    GRPOTrainer._generate_single_turn = fixed_generate
    GRPOTrainer._generate_and_score_completions = score
    spec = dataclasses.asdict(dataclasses.replace(w, steps=1, warmup_steps=0))
    ds = datasets.Dataset.from_list(
        [{"prompt": p, "label": lab} for p, lab in zip(batch.prompts, batch.labels)]
    )
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=reward_math,
        args=GRPOConfig(**trl_child.grpo_config_kwargs(spec, str(out / "trl-run"), seed=1)),
        train_dataset=ds, processing_class=tok,
    )  # fmt: skip
    model = trainer.model
    before = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    grads: dict[str, torch.Tensor] = {}
    real_clip = trainer.accelerator.clip_grad_norm_

    def clip(parameters, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - pass-through spy
        parameters = list(parameters)
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return real_clip(parameters, *args, **kwargs)

    trainer.accelerator.clip_grad_norm_ = clip
    trainer.train()
    after = {k: v.detach().float() for k, v in model.state_dict().items()}
    if len(handed) != len(batch.responses):
        raise RuntimeError(f"TRL trained on {len(handed)} responses, the batch has {len(batch.responses)}")
    tokens, advantages = [], []
    for j in range(len(handed)):
        p = scored["prompt_ids"][j][scored["prompt_mask"][j].bool()].tolist()
        c = scored["completion_ids"][j][scored["completion_mask"][j].bool()].tolist()
        tokens.append(p + c)
        advantages.append(float(scored["advantages"][j]))
    order = sorted(range(len(handed)), key=lambda j: handed[j])  # back to batch order
    torch.save(
        {
            "grads": grads,
            "delta": {k: after[k] - before[k] for k in before},
            "tokens": [tokens[j] for j in order],
            "response_lengths": [int(scored["completion_mask"][j].sum()) for j in order],
            "rewards": [rewards[j] for j in order],
            "advantages": [advantages[j] for j in order],
        },
        out / "trl.pt",
    )


# ------------------------------------------------------------------------------------------------ comparison
@dataclass
class TensorCompare:
    name: str
    numel: int
    grad_cosine: float
    grad_norm_ratio: float  # |miles grad| / |TRL grad|
    delta_cosine: float  # of the parameter changes of the step


@dataclass
class Comparison:
    same_tokens: bool  # every sample's prompt + response ids are the same on both sides
    same_response_lengths: bool
    max_reward_diff: float
    max_advantage_diff: float
    miles_grad_norm: float  # global, before clipping
    trl_grad_norm: float
    global_grad_cosine: float  # over all parameters
    tensors: list[TensorCompare]

    @property
    def min_grad_cosine(self) -> float:
        return min(t.grad_cosine for t in self.tensors if t.numel)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else float("nan")


def gather_miles(out: Path, ranks: int, n: int) -> dict[str, object]:
    """miles.pt plus the per-rank sample records put back in batch order."""
    result = torch.load(out / "miles.pt", weights_only=False)
    per_sample: dict[str, list[object]] = {
        k: [None] * n for k in ("tokens", "response_lengths", "rewards", "advantages")
    }
    for r in range(ranks):
        part = torch.load(out / f"miles-rank{r}.pt", weights_only=False)
        for j, i in enumerate(part["indices"]):
            for k in per_sample:
                per_sample[k][i] = part[k][j]
    result.update(per_sample)
    return result


def compare(miles: dict[str, object], trl: dict[str, object]) -> Comparison:
    """Per-tensor and global comparison of the two sides' records (see the module docstring)."""
    mg, tg = miles["grads"], trl["grads"]
    if set(mg) != set(tg):
        raise ValueError(f"parameter names differ: only miles {sorted(set(mg) - set(tg))}, "
                         f"only TRL {sorted(set(tg) - set(mg))}")  # fmt: skip
    tensors = [
        TensorCompare(
            name=k,
            numel=mg[k].numel(),
            grad_cosine=_cosine(mg[k], tg[k]),
            grad_norm_ratio=float(mg[k].norm() / tg[k].norm()) if float(tg[k].norm()) > 0 else float("nan"),
            delta_cosine=_cosine(miles["delta"][k], trl["delta"][k]),
        )  # fmt: skip
        for k in sorted(mg)
    ]
    flat_m = torch.cat([mg[k].double().flatten() for k in sorted(mg)])
    flat_t = torch.cat([tg[k].double().flatten() for k in sorted(mg)])
    return Comparison(
        same_tokens=miles["tokens"] == trl["tokens"],
        same_response_lengths=miles["response_lengths"] == trl["response_lengths"],
        max_reward_diff=max(abs(a - b) for a, b in zip(miles["rewards"], trl["rewards"])),
        max_advantage_diff=max(abs(a - b) for a, b in zip(miles["advantages"], trl["advantages"])),
        miles_grad_norm=float(flat_m.norm()),
        trl_grad_norm=float(flat_t.norm()),
        global_grad_cosine=_cosine(flat_m, flat_t),
        tensors=tensors,
    )


def format_comparison(c: Comparison, miles: dict[str, object], trl: dict[str, object]) -> str:
    rewards = miles["rewards"]
    lines = [
        f"samples {len(rewards)}, rewarded {sum(1 for r in rewards if r > 0)}; same token ids: {c.same_tokens}; "
        f"same response lengths: {c.same_response_lengths}",
        f"max |reward diff| {c.max_reward_diff:.3g}; max |advantage diff| {c.max_advantage_diff:.3g}",
        f"grad norm (before clipping): miles {c.miles_grad_norm:.6g}, TRL {c.trl_grad_norm:.6g}; "
        f"global grad cosine {c.global_grad_cosine:.6f}; min per-tensor grad cosine {c.min_grad_cosine:.6f}",
        f"{'tensor':52s} {'numel':>8s} {'grad cos':>9s} {'|g| m/t':>8s} {'step cos':>9s}",
    ]
    lines += [
        f"{t.name:52s} {t.numel:8d} {t.grad_cosine:9.5f} {t.grad_norm_ratio:8.4f} {t.delta_cosine:9.5f}"
        for t in c.tensors
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ driver
def run(
    w: Workload, work: Path, trl_venv: Path, miles_ranks: int, seed: int, rollout: Path | None = None
) -> tuple[Comparison, str]:
    """Build `w`'s model, sample the batch (or read it from `rollout`, see `batch_from_rollout`), run both sides
    as subprocesses; returns the comparison and its text."""
    from miles.utils.net import free_port

    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(w, work / "model")
    batch = batch_from_rollout(rollout, w.n_samples) if rollout else sample_batch(w, model_dir, seed)
    (work / "batch.json").write_text(json.dumps(batch.to_json()))
    write_rows(make_rows(w, w.n_prompts, seed=0), work / "prompts.jsonl")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    common = [
        str(Path(__file__).resolve()),
        "--workload-json",
        json.dumps(dataclasses.asdict(w)),
        "--work-dir",
        str(work),
    ]
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *common, "--side", "miles", "--miles-ranks", str(miles_ranks)],
            env=dict(
                env,
                RANK=str(r),
                WORLD_SIZE=str(miles_ranks),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
        )  # fmt: skip
        for r in range(miles_ranks)
    ]
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise RuntimeError(f"miles side failed: exit codes {codes}")
    trl_python = trl_venv / "bin" / "python"
    code = subprocess.run([str(trl_python), *common, "--side", "trl"], env=env, timeout=900).returncode
    if code:
        raise RuntimeError(f"TRL side ({trl_python}) failed: exit code {code}")
    miles = gather_miles(work, miles_ranks, len(batch.responses))
    trl = torch.load(work / "trl.pt", weights_only=False)
    c = compare(miles, trl)
    return c, format_comparison(c, miles, trl)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="varlen", help="a workload of bench_workloads (plain-text prompts)")
    p.add_argument("--quick", action="store_true", help="the workload's shrunk --quick copy")
    p.add_argument("--trl-venv", default=str(DEFAULT_TRL_VENV), help="venv with TRL (see vs_trl.py)")
    p.add_argument("--work-dir", default=None, help="default: runs/grad-vs-trl")
    p.add_argument("--miles-ranks", type=int, default=1, help="gloo ranks of the miles trainer (DP size)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the fixed batch")
    p.add_argument(
        "--rollout", default=None, help="train on this saved rollout instead (see batch_from_rollout)"
    )
    p.add_argument("--side", choices=("miles", "trl"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload-json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    work = Path(a.work_dir or REPO / "runs" / "grad-vs-trl")
    if a.side is not None:  # a child: the workload and batch come from the parent
        w = Workload(**json.loads(a.workload_json))
        batch = FixedBatch(**json.loads((work / "batch.json").read_text()))
        if a.side == "miles":
            miles_rank(int(os.environ["RANK"]), a.miles_ranks, w, work / "model", batch, work)
        else:
            trl_side(w, work / "model", batch, work)
        return 0
    w = get_workload(a.workload)
    w = w.quick() if a.quick else w
    _, text = run(w, work, Path(a.trl_venv), a.miles_ranks, a.seed, Path(a.rollout) if a.rollout else None)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
