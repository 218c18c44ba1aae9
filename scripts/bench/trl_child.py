"""TRL side of `vs_trl.py`: one GRPOTrainer run, run by the TRL venv's Python. Not for direct use.

    .venv-trl/bin/python scripts/bench/trl_child.py --model DIR --data FILE --spec JSON --out DIR --seed N
        [--settings-only] [--override JSON]

`--spec` is the workload as JSON (`bench_workloads.Workload` fields). Prints one `BENCH_EVENT {json}` line per
event (settings, train_begin, step_begin, step_end, log) with the wall time, which the parent reads; "settings"
holds the trainer's effective settings in the words of `bench_workloads.SETTING_ROWS` (read off the built trainer,
its generation config and its optimizer, not off the arguments given). The reward is miles' own "math" reward
function (`miles.rollout.rm_hub.math_utils.math_reward`), so both systems score identically.
`--settings-only` builds the trainer and its optimizer, prints the settings event and exits without training;
`--override` changes GRPOConfig fields (a check that the settings table catches a difference uses it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from bench_workloads import SHARED, optimizer_text, sampling_text

if TYPE_CHECKING:
    from torch.optim import Optimizer
    from trl import GRPOTrainer

EVENT = "BENCH_EVENT "
# TRL loss types in miles' --loss-reduction words, where they are the same reduction (checked for "grpo" by
# scripts/bench/grad_vs_trl.py: equal gradients on the same batch); the others keep TRL's name.
TRL_LOSS_AS_MILES = {"grpo": "sample_mean"}
TRL_SCALE_REWARDS = {
    "group": "group mean / group std",
    "batch": "group mean / batch std",
    "none": "group mean",
}


def emit(kind: str, **payload: object) -> None:
    print(EVENT + json.dumps({"event": kind, "time": time.time(), **payload}), flush=True)


def grpo_config_kwargs(spec: dict, out_dir: str, seed: int) -> dict:
    """GRPOConfig arguments equivalent to miles' settings for this workload (see vs_trl.miles_command)."""
    batch = spec["n_prompts"] * spec["n_samples"]
    mbs = spec["micro_batch_size"]
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=batch // mbs,  # one optimizer step per generation of `batch` samples
        num_generations=spec["n_samples"],
        max_completion_length=spec["max_response_len"],
        temperature=SHARED.temperature,
        top_p=SHARED.top_p,
        top_k=0,  # off (TRL's default; transformers skips its top-k warper for 0 or None)
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=SHARED.weight_decay,
        adam_beta1=SHARED.adam_beta1,
        adam_beta2=SHARED.adam_beta2,
        adam_epsilon=SHARED.adam_eps,
        max_grad_norm=SHARED.clip_grad,
        optim="adamw_torch",
        beta=0.0,  # no reference model, as miles without --use-kl-loss
        num_iterations=1,
        epsilon=SHARED.eps_clip,
        epsilon_high=SHARED.eps_clip_high,
        loss_type="grpo",  # per-sequence token mean, then mean over sequences (miles' sample_mean; TRL 1.x: "dapo")
        scale_rewards="group",
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        shuffle_dataset=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"},
    )


def trl_settings(trainer: GRPOTrainer, optimizer: Optimizer, chat: bool) -> dict[str, str]:
    """The trainer's effective settings, row by row of `bench_workloads.SETTING_ROWS` (but "lr logged per step",
    which the parent reads off the logs). `chat`: the dataset's prompts are chat messages (TRL then applies the
    chat template; it decides that from the data)."""
    a = trainer.args
    g = trainer.num_generations
    step_samples = a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size
    gen = trainer.generation_config
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    groups = inner.param_groups
    decays = sorted({float(pg["weight_decay"]) for pg in groups if pg["params"]})
    optim = optimizer_text(
        type(inner).__name__, tuple(groups[0]["betas"]), float(groups[0]["eps"]), decays[-1]
    )
    if len(decays) > 1:  # transformers exempts biases and norm weights from weight decay
        optim += f" (some parameters {decays[0]:g})"
    loss = f"PPO clip {trainer.epsilon_low:g}/{trainer.epsilon_high:g}, "
    loss += TRL_LOSS_AS_MILES.get(trainer.loss_type, f"TRL loss_type {trainer.loss_type}")
    if trainer.importance_sampling_level != "token":
        loss += f", importance sampling per {trainer.importance_sampling_level}"
    if a.delta is not None:
        loss += f", two-sided clip delta {a.delta:g}"
    if trainer.mask_truncated_completions:
        loss += ", truncated responses masked"
    if trainer.top_entropy_quantile < 1.0:
        loss += f", top-entropy quantile {trainer.top_entropy_quantile:g}"
    return {
        "prompts x samples per rollout": f"{a.generation_batch_size // g} x {g}",
        "samples per optimizer step": str(step_samples),
        "optimizer steps per rollout": str(a.generation_batch_size // step_samples * trainer.num_iterations),
        "micro-batch (samples)": str(a.per_device_train_batch_size),
        "prompt format": "chat template" if chat else "plain text",
        "prompt order": "shuffled" if trainer.shuffle_dataset else "file order",
        "sampling": sampling_text(gen.temperature, gen.top_p, gen.top_k, gen.min_p, gen.repetition_penalty),
        "max response tokens": str(trainer.max_completion_length),
        "stop token ids": str(sorted(trainer.eos_token_ids)),
        "reward text": "special tokens dropped",  # GRPOTrainer decodes completions with skip_special_tokens=True
        "advantages": TRL_SCALE_REWARDS.get(
            str(trainer.scale_rewards), f"scale_rewards={trainer.scale_rewards}"
        ),
        "policy loss": loss,
        "KL": "off" if trainer.beta == 0 else f"loss k3 x{trainer.beta:g}",
        "optimizer": optim,
        "grad clip": f"{a.max_grad_norm:g}",
        "lr schedule": (
            f"{a.learning_rate:g} {a.lr_scheduler_type.value}, warmup {a.get_warmup_steps(a.max_steps)} steps"
        ),
        "seed": str(a.seed),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--spec", required=True, help="workload as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settings-only", action="store_true", help="print the settings event, do not train")
    p.add_argument("--override", default="{}", help="GRPOConfig fields to change, as JSON")
    a = p.parse_args(argv)
    spec = json.loads(a.spec)
    config_kwargs = {**grpo_config_kwargs(spec, a.out, a.seed), **json.loads(a.override)}

    import datasets
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles.rollout.rm_hub.math_utils import math_reward

    emit(
        "versions", trl=trl.__version__, transformers=transformers.__version__, datasets=datasets.__version__
    )

    def reward_math(prompts, completions, label, **kwargs):  # noqa: ANN001 - TRL's reward signature
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_reward(t, lab) for t, lab in zip(texts, label)]

    ds = datasets.load_dataset("json", data_files=a.data, split="train")
    chat = isinstance(ds[0]["prompt"], list)
    trainer: GRPOTrainer | None = None

    class Events(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):  # noqa: ANN001
            assert trainer is not None and optimizer is not None
            emit("settings", settings=trl_settings(trainer, optimizer, chat))
            emit("train_begin")

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            emit("step_begin", step=state.global_step)

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            emit("step_end", step=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            emit("log", step=state.global_step, logs={k: v for k, v in (logs or {}).items()})

    tok = AutoTokenizer.from_pretrained(a.model)
    trainer = GRPOTrainer(
        model=a.model,
        reward_funcs=reward_math,
        args=GRPOConfig(**config_kwargs),
        train_dataset=ds,
        processing_class=tok,
        callbacks=[Events()],
    )
    if a.settings_only:  # the optimizer train() would build: Trainer.create_optimizer keeps one already made
        emit("settings", settings=trl_settings(trainer, trainer.create_optimizer(), chat))
        return
    trainer.train()
    emit("done")


if __name__ == "__main__":
    main(sys.argv[1:])
