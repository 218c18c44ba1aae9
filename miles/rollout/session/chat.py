"""OpenAI chat messages as the session server reads, compares, renders and answers them (pure Python).

- `normalize_message`: one request message as a plain dict the chat template reads (`role`, `content` text,
  `tool_calls` with parsed arguments, `tool_call_id`, `name`); content parts (`[{"type": "text", ...}]`) are
  joined; fields the OpenAI SDK echoes back (`refusal`, `audio`, `annotations`, ...) are dropped, so a message
  the agent sends back compares equal to the one the server answered.
- `parse_tool_calls`: Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a sampled
  turn as OpenAI `tool_calls`, and the text around them as the content. A block whose JSON does not parse stays
  in the content (the agent sees what the model wrote).
- `completion_body` / `chunk_bodies`: the OpenAI `chat.completion` object and its `chat.completion.chunk`
  stream form.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_of(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"{where}: only text content parts are supported, got {part!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError(
        f"{where}: content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _arguments(raw: object, where: str) -> object:
    """Tool-call arguments as the template reads them: the parsed JSON object (a string that is not JSON stays)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    if isinstance(raw, dict):
        return raw
    raise ValueError(f"{where}: function.arguments must be a JSON string, got {type(raw).__name__}")


def normalize_message(msg: object, i: int) -> Message:
    """Message `i` of a request as a template-ready dict; ValueError naming the message and the problem."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise ValueError(f"{where}: expected an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in _ROLES:
        raise ValueError(f"{where}: role {role!r} is not one of {_ROLES}")
    out: Message = {"role": "system" if role == "developer" else role}
    out["content"] = _text_of(msg.get("content"), where)
    if role == "assistant" and msg.get("tool_calls"):
        calls = []
        for j, call in enumerate(msg["tool_calls"]):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"{where}.tool_calls[{j}]: expected {{'function': {{'name', 'arguments'}}}}")
            args = _arguments(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]")
            calls.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(msg.get("tool_call_id") or "")
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def normalize_messages(messages: object) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of chat messages")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def same_message(a: Message, b: Message) -> bool:
    """Whether two normalized messages render alike (tool-call ids are the server's naming, not the model's)."""
    strip = ("tool_call_id",)
    return {k: v for k, v in a.items() if k not in strip} == {k: v for k, v in b.items() if k not in strip}


def turn_text(tokenizer: Any, ids: list[int]) -> str:
    """The text of sampled ids without special tokens, except the tool-call markers (special in some
    tokenizers, plain added tokens in Qwen3's)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    for special in tokenizer.all_special_tokens:
        if special not in ("<tool_call>", "</tool_call>"):
            text = text.replace(special, "")
    return text


@dataclass(frozen=True)
class ParsedTurn:
    """A sampled assistant turn as the API answers it."""

    content: str | None
    tool_calls: list[dict[str, Any]]  # [{"name": str, "arguments": object}]

    def message(self) -> Message:
        """The normalized assistant message of this turn (what the agent echoes back next time)."""
        msg: Message = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.tool_calls
            ]
        return msg


def parse_tool_calls(text: str, with_tools: bool) -> ParsedTurn:
    """Split a sampled turn's text (special tokens removed) into content and Qwen3-style tool calls."""
    if not with_tools:
        return ParsedTurn(text, [])
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in TOOL_CALL_RE.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    if not calls:
        return ParsedTurn(text, [])
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ParsedTurn(content or None, calls)


@dataclass(frozen=True)
class Choice:
    """One generated choice: its parsed turn, finish reason and per-token log-probs (token text, log-prob)."""

    turn: ParsedTurn
    finish_reason: str  # OpenAI's: "stop" | "length" | "tool_calls"
    logprobs: list[tuple[str, float]] | None
    call_ids: list[str]


def _tool_calls_json(choice: Choice) -> list[dict[str, Any]]:
    return [
        {
            "id": cid,
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for cid, c in zip(choice.call_ids, choice.turn.tool_calls)
    ]


def _logprobs_json(entries: list[tuple[str, float]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in entries
        ],
        "refusal": None,
    }


def completion_body(cid: str, model: str, choices: list[Choice], prompt_tokens: int, completion: int) -> dict:
    """The `chat.completion` object of a request (usage counts the prompt once and every choice's tokens)."""
    out = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.turn.content, "refusal": None}
        if c.turn.tool_calls:
            message["tool_calls"] = _tool_calls_json(c)
        out.append(
            {
                "index": i,
                "message": message,
                "finish_reason": c.finish_reason,
                "logprobs": _logprobs_json(c.logprobs),
            }
        )
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
    }


def chunk_bodies(body: dict) -> list[dict]:
    """A finished `chat.completion` as its stream of `chat.completion.chunk` objects: per choice a role chunk,
    a content chunk, one chunk per tool call, and a finish chunk; then a usage chunk (empty choices)."""
    base = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
    }
    chunks = []
    for c in body["choices"]:
        msg, i = c["message"], c["index"]
        chunks.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]})
        if msg.get("content"):
            delta = {"index": i, "delta": {"content": msg["content"]}, "logprobs": c["logprobs"]}
            chunks.append({**base, "choices": [delta]})
        for k, call in enumerate(msg.get("tool_calls") or []):
            tc = {"index": k, **call}
            chunks.append({**base, "choices": [{"index": i, "delta": {"tool_calls": [tc]}}]})
        chunks.append({**base, "choices": [{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}]})
    chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks
