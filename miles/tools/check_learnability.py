"""Check that a toy task is learnable by GRPO-style RL on the tiny model, with plain torch on a CPU.

Per step: draw `--prompts` prompts, sample `--n` responses each (temperature 1, up to `--max-new-tokens`),
score them with the reward hub, take GRPO advantages (`miles.algo`: rewards normalised within each prompt group),
and take one Adam step on miles' policy loss (`miles.algo.compute_loss`, token mean over the batch; on-policy, so
its gradient is REINFORCE's, `-sum(adv * grad log p(response token)) / (number of response tokens)`). Prints the
mean reward per step and the wall time. This is independent of the Ray/FSDP stack: it tells whether the task
and model sizes are right before an end-to-end run.

    python -m miles.tools.check_learnability --task echo --steps 40 --prompts 16 --n 8 --lr 5e-3

Measured with the defaults (tiny model hidden 64, 2 layers, vocab 48; task "echo"; 2 new tokens; 16 prompts x
8 samples per step; Adam lr 5e-3, no clipping; 40 steps; 13-25 s on one CPU thread), mean reward over the
first 3 -> last 3 steps, seeds 0/1/2:
  plain prompts:      0.057 -> 0.727, 0.036 -> 0.701, 0.065 -> 0.984  (+0.3 reached by step ~12-20)
  `--format chat`:    0.044 -> 0.711, 0.026 -> 0.734, 0.044 -> 0.951  (+0.3 reached by step ~20-32)
With 8 prompts per step (64 samples) learning is about half as fast and noisier; lr 1e-2 collapses often.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles.algo import (
    AdvantageInputs,
    LossInputs,
    LossReduction,
    LossSettings,
    compute_advantages,
    compute_log_probs,
    compute_loss,
)
from miles.rollout.rm_hub import RewardContext, get_reward_fn
from miles.tools.tiny_model import build_tiny_model
from miles.tools.toy_data import DEFAULT_TASK, FORMATS, TASKS, make_rows
from miles.utils.types import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class StepStats:
    """Result of one RL step."""

    step: int
    mean_reward: float
    seconds: float


@torch.no_grad()
def _sample(
    model: PreTrainedModel, prompt_ids: list[int], n: int, max_new_tokens: int, eos_id: int
) -> list[list[int]]:
    """Sample `n` responses for one prompt at temperature 1 (KV cache; stops per row at eos)."""
    ids = torch.tensor([prompt_ids] * n)
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    responses: list[list[int]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        tok = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1)  # [n, 1]
        for i in range(n):
            if not done[i]:
                responses[i].append(int(tok[i]))
        done |= tok[:, 0] == eos_id
        if bool(done.all()):
            break
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return responses


def _prompt_ids(tok: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a plain-string prompt, or of chat messages through the chat template."""
    if isinstance(prompt, str):
        return list(tok(prompt)["input_ids"])  # as miles.rollout.data_source does
    out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _loss(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    adv: list[float],
    pad_id: int,
) -> torch.Tensor:
    """miles' policy loss (`miles.algo.compute_loss`, PPO clip, token mean over the batch) of one on-policy
    step: old log-probs are the detached new ones, so the ratio is 1 and the gradient is REINFORCE's,
    `-grad sum_i sum_t adv_i * log p(y_it)` over the batch's response-token count.

    One right-padded forward over prompt + response; only response tokens count.
    """
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    log_probs = [
        compute_log_probs(logits[i, len(p) - 1 : len(p) + len(r) - 1], torch.tensor(r))
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]
    masks = [torch.ones(len(r)) for r in responses]
    inputs = LossInputs(
        log_probs=log_probs,
        old_log_probs=[lp.detach() for lp in log_probs],
        advantages=[torch.full((len(r),), a) for r, a in zip(responses, adv)],
        loss_masks=masks,
    )
    tokens = float(max(1, sum(len(r) for r in responses)))
    settings = LossSettings(reduction=LossReduction(kind="token_mean", denominator=tokens))
    return compute_loss(inputs, settings)[0]


def _group_advantages(rewards: list[float], n: int) -> list[float]:
    """GRPO advantages (`miles.algo`, group of `n` consecutive samples per prompt): (r - mean) / (std + eps)."""
    out = compute_advantages(
        "grpo",
        AdvantageInputs(
            rewards=torch.tensor(rewards, dtype=torch.float32),
            group_ids=torch.arange(len(rewards)) // n,
            loss_masks=[torch.ones(1) for _ in rewards],
        ),
    )
    return [float(a[0]) for a in out.advantages]


def run(
    task: str = DEFAULT_TASK,
    steps: int = 40,
    prompts_per_step: int = 16,
    n: int = 8,
    lr: float = 5e-3,
    max_new_tokens: int = 2,
    hidden_size: int = 64,
    num_layers: int = 2,
    rm_type: str = "math",
    seed: int = 0,
    model_dir: str | None = None,
    fmt: str = "plain",
    grad_clip: float | None = None,
) -> list[StepStats]:
    """Run the GRPO-style check and return per-step stats (also printed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir or str(build_tiny_model(os.path.join(tmp, "m"), task, seed, hidden_size, num_layers))
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    reward_fn = get_reward_fn(rm_type)
    ctx = RewardContext(rm_type=rm_type)  # the built-in local rewards read nothing from it
    rows = make_rows(task, 1000, seed, fmt)
    stats: list[StepStats] = []
    t0 = time.perf_counter()
    for step in range(steps):
        batch = rng.sample(rows, prompts_per_step)
        prompts, responses, rewards = [], [], []
        for row in batch:
            p_ids = _prompt_ids(tok, row["prompt"])
            group = _sample(model, p_ids, n, max_new_tokens, tok.eos_token_id)
            scores = []
            for r in group:
                sample = Sample(tokens=p_ids + r, response_length=len(r), label=row["label"])
                sample.response = tok.decode(r, skip_special_tokens=True)
                score = reward_fn(ctx, sample)
                assert isinstance(score, int | float), (
                    f"--rm-type {rm_type}: a number was expected, got {score!r}"
                )
                scores.append(float(score))
            prompts += [p_ids] * n
            responses += group
            rewards += scores
        adv = _group_advantages(rewards, n)
        loss = _loss(model, prompts, responses, adv, tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        stats.append(StepStats(step, sum(rewards) / len(rewards), time.perf_counter() - t0))
        print(f"step {step:3d}  reward {stats[-1].mean_reward:.3f}  t {stats[-1].seconds:6.1f}s", flush=True)
    return stats


def main(argv: list[str] | None = None) -> None:
    """CLI: print the reward curve of a GRPO-style run on a toy task."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default=DEFAULT_TASK, choices=sorted(TASKS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--rm-type", default="math")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="use this tiny model instead of building one")
    p.add_argument("--format", default="plain", choices=FORMATS, help="prompt format of the toy rows")
    p.add_argument("--grad-clip", type=float, default=None, help="clip the gradient norm (off by default)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    stats = run(
        a.task,
        a.steps,
        a.prompts,
        a.n,
        a.lr,
        a.max_new_tokens,
        a.hidden_size,
        a.num_layers,
        a.rm_type,
        a.seed,
        a.model_dir,
        a.format,
        a.grad_clip,
    )
    k = min(3, len(stats))
    first = sum(s.mean_reward for s in stats[:k]) / k
    last = sum(s.mean_reward for s in stats[-k:]) / k
    print(f"first {k} steps mean reward {first:.3f}; last {k} {last:.3f}; wall {stats[-1].seconds:.1f}s")


if __name__ == "__main__":
    main()
