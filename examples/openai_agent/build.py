"""Build the OpenAI-agent example's tiny model and datasets: the calculator example's (examples/calculator/build.py)
with a Qwen3-style chat template that offers the request's `tools` in the system turn and renders tool answers
as `<tool_response>` (`miles.tools.tiny_model.QWEN3_TOOL_TEMPLATE`), and a tokenizer that covers those texts.

    python -m examples.openai_agent.build --out artifacts/openai_agent
"""

from __future__ import annotations

import argparse
from pathlib import Path

from examples.calculator import build as calc
from examples.openai_agent.agent import TOOLS
from miles.tools.tiny_model import QWEN3_TOOL_TEMPLATE, build_tiny_model, build_tokenizer
from miles.tools.toy_data import write_jsonl

VOCAB_SIZE = 160


def corpus() -> list[str]:
    """The calculator corpus plus episodes rendered by the tool template (every character they use)."""
    tok = build_tokenizer("echo10", VOCAB_SIZE, calc.corpus(), calc.TOOL_TOKENS)
    tok.chat_template = QWEN3_TOOL_TEMPLATE
    texts = calc.corpus()
    for a, op, b in calc.PROBLEMS[::7]:
        messages = [
            {"role": "user", "content": calc.question(a, op, b)},
            {"role": "assistant", "content": f"<tool_call>{a} {op} {b}</tool_call>"},
            {"role": "tool", "tool_call_id": "call_0", "content": str(calc.value(a, op, b))},
            {"role": "assistant", "content": str(calc.value(a, op, b))},
        ]
        texts.append(tok.apply_chat_template(messages, tools=TOOLS, tokenize=False))
    return texts


def build(out: str | Path, seed: int = 0, n_train: int = 2000, n_eval: int = 16) -> Path:
    """Model (tool template), tokenizer and data under `out` (rebuilt when they exist)."""
    from transformers import AutoTokenizer

    out = Path(out)
    model = build_tiny_model(
        out / "model", task="echo10", seed=seed, vocab_size=VOCAB_SIZE, overwrite=True,
        extra_texts=corpus(), extra_special_tokens=calc.TOOL_TOKENS,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = QWEN3_TOOL_TEMPLATE
    tok.save_pretrained(model)
    write_jsonl(calc.make_rows(n_train, seed), out / "train.jsonl")
    write_jsonl(calc.make_rows(n_eval, seed + 1), out / "eval.jsonl")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote the OpenAI-agent example to {build(a.out, a.seed)}")


if __name__ == "__main__":
    main()
