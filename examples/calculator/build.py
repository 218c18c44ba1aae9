"""Build the calculator example's tiny model, tokenizer and datasets.

    python -m examples.calculator.build --out artifacts/calculator

Writes `<out>/model` (a random tiny Qwen3 whose tokenizer has `<tool_call>` / `</tool_call>` as single tokens),
`<out>/train.jsonl` and `<out>/eval.jsonl`. A row: `{"prompt": "calc 9 - 2", "label": "7",
"metadata": {"expression": "9 - 2"}}`; every result is one digit. Without the tool the tiny model would have
to learn 110 facts one by one; with it, the answer is one copy away.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from miles.tools.tiny_model import build_tiny_model
from miles.tools.toy_data import write_jsonl

TOOL_TOKENS = ("<tool_call>", "</tool_call>")
PROBLEMS = [(a, "+", b) for a in range(10) for b in range(10) if a + b <= 9] + [
    (a, "-", b) for a in range(10) for b in range(10) if a >= b
]  # (a, op, b) with a one-digit result


def question(a: int, op: str, b: int) -> str:
    return f"calc {a} {op} {b}"


def value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def make_rows(n: int, seed: int) -> list[dict[str, object]]:
    """`n` questions, deterministic in `seed`."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        a, op, b = rng.choice(PROBLEMS)
        rows.append(
            {
                "prompt": question(a, op, b),
                "label": str(value(a, op, b)),
                "metadata": {"expression": f"{a} {op} {b}"},
            }
        )
    return rows


def corpus() -> list[str]:
    """Texts covering every character of the prompts, the tool calls and the tool answers (chat formatted)."""
    texts = []
    for a, op, b in PROBLEMS:
        v = value(a, op, b)
        texts.append(
            f"<|im_start|>user\n{question(a, op, b)}<|im_end|>\n<|im_start|>assistant\n"
            f"<tool_call>{a} {op} {b}</tool_call><|im_end|>\n<|im_start|>tool\n{v}<|im_end|>\n"
            f"<|im_start|>assistant\n{v}<|im_end|>\n"
        )
    texts.append("error: ValueError: cannot evaluate - * 0123456789")
    return texts


def build(out: str | Path, seed: int = 0, n_train: int = 2000, n_eval: int = 16) -> Path:
    """Model, tokenizer and data under `out` (rebuilt when they exist)."""
    out = Path(out)
    build_tiny_model(
        out / "model", task="echo10", seed=seed, vocab_size=64, overwrite=True,
        extra_texts=corpus(), extra_special_tokens=TOOL_TOKENS,
    )  # fmt: skip
    write_jsonl(make_rows(n_train, seed), out / "train.jsonl")
    write_jsonl(make_rows(n_eval, seed + 1), out / "eval.jsonl")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote the calculator example to {build(a.out, a.seed)}")


if __name__ == "__main__":
    main()
