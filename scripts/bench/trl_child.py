"""TRL side of `vs_trl.py`: one GRPOTrainer run, run by the TRL venv's Python. Not for direct use.

    .venv-trl/bin/python scripts/bench/trl_child.py --model DIR --data FILE --spec JSON --out DIR

`--spec` is the workload as JSON (`bench_workloads.Workload` fields). Prints one `BENCH_EVENT {json}` line per
event (train_begin, step_begin, step_end, log) with the wall time, which the parent reads. The reward is miles'
own "math" reward function (`miles.rollout.rm_hub.math_utils.math_reward`), so both systems score identically.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

EVENT = "BENCH_EVENT "


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
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,  # no reference model, as miles without --use-kl-loss
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="grpo",  # per-sequence token mean, then mean over sequences (miles' sample_mean)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--spec", required=True, help="workload as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    spec = json.loads(a.spec)

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

    class Events(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            emit("train_begin")

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            emit("step_begin", step=state.global_step)

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            emit("step_end", step=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            emit("log", step=state.global_step, logs={k: v for k, v in (logs or {}).items()})

    ds = datasets.load_dataset("json", data_files=a.data, split="train")
    tok = AutoTokenizer.from_pretrained(a.model)
    trainer = GRPOTrainer(
        model=a.model,
        reward_funcs=reward_math,
        args=GRPOConfig(**grpo_config_kwargs(spec, a.out, a.seed)),
        train_dataset=ds,
        processing_class=tok,
        callbacks=[Events()],
    )
    trainer.train()
    emit("done")


if __name__ == "__main__":
    main(sys.argv[1:])
