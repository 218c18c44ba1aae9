"""A calculator agent that compacts its history mid-episode, written against the OpenAI chat API.

    --use-session-server --agent-function-path examples.openai_agent.compacting:run

After the tool answers, the agent replaces the conversation so far (the question, its tool call and the tool's
answer) with one user turn that summarises it, as long-running agents do when their context fills up, and asks
for the final answer. The session server sees an edited history: the episode becomes a tree with two leaves
(the call before the compaction, the answer after it), each a training sample; the default post-processor
trains every sampled token exactly once. The reward is `agent.reward` of the final answer.
"""

from __future__ import annotations

from typing import Any

from examples.openai_agent.agent import TOOLS, _messages, call_tool, reward
from miles.utils.types import Sample


def compact(question: list[dict[str, Any]], result: str) -> list[dict[str, Any]]:
    """The compacted history: one user turn with the question and the tool's answer."""
    asked = " ".join(str(m.get("content") or "") for m in question if m.get("role") == "user")
    return [{"role": "user", "content": f"{asked}\ncalc says {result}. Answer with the number."}]


async def run(base_url: str, sample: Sample, ctx: Any) -> float:
    """Ask once with the tool; when the model calls it, compact the history around the tool's answer and ask
    again without tools; reward the final answer."""
    from openai import AsyncOpenAI

    question = _messages(sample)
    async with AsyncOpenAI(base_url=base_url, api_key=ctx.api_key, max_retries=0) as client:
        out = await client.chat.completions.create(model="policy", messages=question, tools=TOOLS)
        message = out.choices[0].message
        content = message.content or ""
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        if not calls and "<tool_call>" in content:  # a call the tiny model could not write as JSON yet
            calls = [("calc", "")]
        if not calls:
            return reward(content, False, sample.label)
        result = call_tool(*calls[0], sample)
        out = await client.chat.completions.create(model="policy", messages=compact(question, result))
        return reward(out.choices[0].message.content or "", True, sample.label)
