"""A calculator agent written against the OpenAI chat API, trained as it is through the session server.

    --use-session-server --agent-function-path examples.openai_agent.agent:run

`run` is plain agent code: the official `openai` client pointed at the session's `base_url`, a `calc` tool the
model may call over several turns, and a reward computed from the final answer (return None instead to let
--custom-rm-path / --rm-type score the sample). Build its tiny model with `python -m examples.openai_agent.build`
(a Qwen3-style template that offers the tools). The session server records every turn token for token.
"""

from __future__ import annotations

import json
import re
from typing import Any

from examples.calculator.tool import evaluate
from miles.utils.types import Sample

MAX_TURNS = 2
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate 'a + b', 'a - b' or 'a * b' for integers a and b.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def call_tool(name: str, arguments: str, sample: Sample) -> str:
    """The tool's answer (errors are answers too: the model sees them). The tool is bound to the task, like a
    sandbox bound to a repository: a call without a complete expression evaluates the question's
    (`sample.metadata["expression"]`), so the tiny model only has to learn when to call it and how to use its
    answer."""
    if name != "calc":
        return f"error: no tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
        expression = str(args.get("expression", "")) if isinstance(args, dict) else str(args)
    except ValueError:
        expression = arguments
    try:
        return str(evaluate(expression))
    except ValueError as e:
        if "expression" in sample.metadata:
            return str(evaluate(str(sample.metadata["expression"])))
        return f"error: {e}"


def _messages(sample: Sample) -> list[dict[str, Any]]:
    if isinstance(sample.prompt, list):
        return [dict(m) for m in sample.prompt]
    return [{"role": "user", "content": sample.prompt}]


def reward(final: str, called: bool, label: object) -> float:
    """1.0 when the final turn answers the label (its first number); else partial credit that makes each step
    towards using the tool worth repeating: 0.4 for calling it, 0.3 more for then answering a number."""
    numbers = re.findall(r"-?\d+", final) if "<tool_call>" not in final else []
    if numbers and numbers[0] == str(label).strip():
        return 1.0
    return 0.4 * called + 0.3 * (called and bool(numbers))


async def run(base_url: str, sample: Sample, ctx: Any) -> float:
    """Answer the sample's question, calling `calc` as often as the model asks (at most MAX_TURNS turns).

    A turn that opens a `<tool_call>` the server could not parse as Qwen3's JSON (a tiny model cannot write
    JSON yet) is a call too, of the question's expression: the agent answers it as a tool message."""
    from openai import AsyncOpenAI

    messages = _messages(sample)
    final, called = "", False
    async with AsyncOpenAI(base_url=base_url, api_key=ctx.api_key, max_retries=0) as client:
        for turn in range(MAX_TURNS):
            out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = out.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            content = message.content or ""
            calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
            if not calls and "<tool_call>" in content:
                calls = [(f"call_{turn}", "calc", "")]
            if not calls:
                final = content
                break
            called = True
            for call_id, name, arguments in calls:
                result = call_tool(name, arguments, sample)
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return reward(final, called, sample.label)
