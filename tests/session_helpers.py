"""Shared by the session-server tests: a byte-level BPE tokenizer with a Qwen3-style tool-calling chat template,
and helpers that spell a text as one token per character (a split the tokenizer's merges would not produce)."""

from __future__ import annotations

import string
from functools import lru_cache
from typing import Any

from miles.tools.tiny_model import QWEN3_TOOL_TEMPLATE, build_tokenizer

QWEN_STYLE_TEMPLATE = QWEN3_TOOL_TEMPLATE  # moved to miles.tools.tiny_model (examples use it too)
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
CORPUS = [
    string.printable,
    'The answer is 12. {"name": "calc", "arguments": {"expression": "12 + 30"}} tool_response 42 result',
    "What is 12 + 30? Use the calculator. You are a helpful assistant. Tools system user assistant",
]


# the calculator tool both session-server tests offer the agent (OpenAI's `tools` shape)
CALC_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@lru_cache(maxsize=1)
def qwen_style_tokenizer() -> Any:
    tok = build_tokenizer(vocab_size=260, extra_texts=CORPUS, extra_special_tokens=TOOL_CALL_TOKENS)
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


def char_ids(tok: Any, text: str) -> list[int]:
    """`text` as one token per character (special tokens whole): what a model may sample, though re-tokenizing
    the text merges it differently."""
    ids: list[int] = []
    rest = text
    while rest:
        special = next((s for s in (*TOOL_CALL_TOKENS, tok.eos_token) if rest.startswith(s)), None)
        if special:
            ids.append(tok.convert_tokens_to_ids(special))
            rest = rest[len(special) :]
            continue
        ids.extend(tok.encode(rest[0], add_special_tokens=False))
        rest = rest[1:]
    return ids


class CharTok:
    """A tokenizer stand-in for recorder and tree tests: one token per character (id = code point), a chat
    template `r:content$` per message (`$` is EOS) and `a:` as the generation prompt."""

    eos_token = "$"
    eos_token_id = ord("$")

    def apply_chat_template(
        self, messages: list, tools: Any, tokenize: bool, add_generation_prompt: bool
    ) -> str:
        text = "".join(f"{m['role'][0]}:{m['content']}$" for m in messages)
        return text + ("a:" if add_generation_prompt else "")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}
