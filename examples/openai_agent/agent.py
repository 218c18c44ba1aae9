"""A calculator agent written against the OpenAI chat API, trained as it is through the session server.

    --use-session-server --agent-function-path examples.openai_agent.agent:run

`run` is plain agent code: the official `openai` client pointed at the session's `base_url`, a `calc` tool the
model may call over several turns, and a reward computed from the final answer (return None instead to let
--custom-rm-path / --rm-type score the sample). The session server records every turn token for token.
"""

from __future__ import annotations

import json
import re
from typing import Any

from examples.calculator.tool import evaluate
from miles.utils.types import Sample

MAX_TURNS = 4
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


def call_tool(name: str, arguments: str) -> str:
    """The tool's answer (errors are answers too: the model sees them)."""
    try:
        args = json.loads(arguments or "{}")
        if name != "calc":
            return f"error: no tool {name!r}"
        return str(evaluate(str(args.get("expression", ""))))
    except (ValueError, AttributeError) as e:
        return f"error: {e}"


def _messages(sample: Sample) -> list[dict[str, Any]]:
    if isinstance(sample.prompt, list):
        return [dict(m) for m in sample.prompt]
    return [{"role": "user", "content": sample.prompt}]


async def run(base_url: str, sample: Sample, ctx: Any) -> float:
    """Answer the sample's question, calling `calc` as often as the model asks (at most MAX_TURNS turns);
    reward 1.0 when the final answer's last number is the label."""
    from openai import AsyncOpenAI

    messages = _messages(sample)
    answer = ""
    async with AsyncOpenAI(base_url=base_url, api_key=ctx.api_key, max_retries=0) as client:
        for _ in range(MAX_TURNS):
            out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = out.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                result = call_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+", answer)
    return 1.0 if numbers and numbers[-1] == str(sample.label).strip() else 0.0
