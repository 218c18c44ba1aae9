"""The session server over HTTP with the official `openai` SDK, in front of the fake engine (tests/fake_engine.py).

The SDK parses every answer with its own models, so a field of the wrong shape or type fails here. The engine
'samples' one token per character (a split the tokenizer's merges would not produce), so a recorder that
re-tokenized text would not match the engine's tokens.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from miles.rollout.base_types import AgentSettings, GenerateContext, SamplingSettings
from miles.rollout.generate_client import GenerateClient
from miles.rollout.session.agent import generate_with_agent
from miles.rollout.session.server import SessionServer
from miles.utils.types import Sample, SampleStatus
from tests.fake_engine import FakeEngine, Reply
from tests.session_helpers import CALC_TOOLS, char_ids, qwen_style_tokenizer

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 + 30"}}\n</tool_call>'
SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=400)


class Script:
    """The fake engine's policy: a tool call first, the answer once a tool response is in the prompt; the
    answer's last digit is the choice index (from the request id), so n > 1 choices differ."""

    def __init__(self) -> None:
        self.tok = qwen_style_tokenizer()
        self.sampled: list[list[int]] = []
        self.inputs: list[list[int]] = []

    def __call__(self, input_ids: list[int], params: dict, rid: str) -> Reply:
        text = self.tok.decode(input_ids)
        if "<tool_response>" in text:
            out = f"The answer is 4{int(rid[-1]) + 2}."
        elif "# Tools" in text:
            out = CALL
        else:
            out = f"Hello {rid[-1]}"
        ids = char_ids(self.tok, out) + [self.tok.eos_token_id]
        self.sampled.append(ids)
        self.inputs.append(list(input_ids))
        return Reply(ids)


async def _serving(script: Script, body):  # noqa: ANN202 - a test helper
    engine = FakeEngine(script)
    async with GenerateClient(engine.url, [engine.url], None, 30.0, 8, transport=engine.transport) as client:
        server = SessionServer(client, script.tok, SAMPLING)
        await server.start()
        try:
            return await body(server)
        finally:
            await server.stop()


def _run(body):  # noqa: ANN001, ANN202
    script = Script()
    return script, asyncio.run(_serving(script, body))


def test_tool_episode_over_the_sdk_records_the_engine_tokens() -> None:
    async def body(server: SessionServer):  # noqa: ANN202
        rec = server.open("ep1")
        async with openai.AsyncOpenAI(base_url=server.base_url("ep1"), api_key=server.api_key) as oai:
            models = await oai.models.list()
            assert [m.id for m in models.data] == ["miles-policy"]
            messages: list = [{"role": "user", "content": "What is 12 + 30?"}]
            first = await oai.chat.completions.create(
                model="m", messages=messages, tools=CALC_TOOLS, logprobs=True
            )
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls"
            call = choice.message.tool_calls[0]
            assert call.type == "function" and call.function.name == "calc"
            assert json.loads(call.function.arguments) == {"expression": "12 + 30"}
            assert first.usage.completion_tokens == len(choice.logprobs.content)
            messages.append(choice.message.model_dump())  # what agents do: the SDK's own message back
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
            second = await oai.chat.completions.create(model="m", messages=messages, tools=CALC_TOOLS)
            assert second.choices[0].message.content == "The answer is 42."
            assert second.choices[0].finish_reason == "stop"
        return rec

    script, rec = _run(body)
    [leaf] = rec.leaves()
    assert len(leaf.turns) == 2 and rec.lineages == 1
    assert [t.output_ids for t in leaf.turns] == script.sampled  # token for token what the engine sampled
    assert script.inputs[1][: len(leaf.turns[0].prompt_ids)] == script.inputs[0]
    assert script.inputs[1][len(script.inputs[0]) :][: len(script.sampled[0])] == script.sampled[0]
    response = leaf.tokens[leaf.prompt_len :]
    trained = [t for t, m in zip(response, leaf.loss_mask) if m == 1]
    assert trained == script.sampled[0] + script.sampled[1]
    tok = script.tok  # the sampled split is not what re-tokenizing gives
    assert tok.encode(tok.decode(script.sampled[0]), add_special_tokens=False) != script.sampled[0]


def test_n_choices_logprobs_and_streaming_without_tools() -> None:
    async def body(server: SessionServer):  # noqa: ANN202
        rec = server.open("ep2")
        async with openai.AsyncOpenAI(base_url=server.base_url("ep2"), api_key=server.api_key) as oai:
            msgs = [{"role": "user", "content": "hi"}]
            many = await oai.chat.completions.create(
                model="m", messages=msgs, n=3, logprobs=True, max_tokens=50
            )
            assert [c.message.content for c in many.choices] == ["Hello 0", "Hello 1", "Hello 2"]
            assert [c.index for c in many.choices] == [0, 1, 2]
            assert all(c.logprobs.content[0].logprob < 0 for c in many.choices)
            stream = await oai.chat.completions.create(
                model="m", messages=[*msgs, {"role": "assistant", "content": "Hello 1"}, {"role": "user", "content": "x"}],
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            text, finish, usage = "", None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            assert (text, finish) == ("Hello 0", "stop") and usage.completion_tokens == 8
        return rec

    _, rec = _run(body)
    assert len(rec.nodes) == 4 and rec.lineages == 1
    assert rec.nodes[3].parent == 1  # the streamed request extended the choice the agent kept
    assert len(rec.leaves()) == 3


def test_key_required_and_unsupported_requests_refused() -> None:
    async def body(server: SessionServer):  # noqa: ANN202
        server.open("ep3")
        url = server.base_url("ep3")
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{url}/models")).status_code == 401
        async with openai.AsyncOpenAI(base_url=url, api_key="wrong") as oai:
            with pytest.raises(openai.AuthenticationError):
                await oai.models.list()
        async with openai.AsyncOpenAI(base_url=url, api_key=server.api_key) as oai:
            with pytest.raises(openai.BadRequestError, match="tool_choice"):
                await oai.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    tools=CALC_TOOLS,
                    tool_choice="required",
                )
        async with openai.AsyncOpenAI(base_url=server.base_url("nope"), api_key=server.api_key) as oai:
            with pytest.raises(openai.NotFoundError):
                await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return server.host

    assert _run(body)[1] == "127.0.0.1"


async def _agent_ok(base_url: str, sample: Sample, ctx) -> float:  # noqa: ANN001
    async with openai.AsyncOpenAI(base_url=base_url, api_key=ctx.api_key) as oai:
        out = await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return 1.0 if out.choices[0].message.content.startswith("Hello") else 0.0


async def _agent_raises(base_url: str, sample: Sample, ctx) -> float:  # noqa: ANN001
    await _agent_ok(base_url, sample, ctx)
    raise RuntimeError("the agent's bug")


async def _agent_hangs(base_url: str, sample: Sample, ctx) -> float:  # noqa: ANN001
    await asyncio.sleep(3600)
    return 1.0


def test_agent_failures_cost_their_sample_only() -> None:
    script = Script()
    tok = script.tok
    prompt = tok.encode("hi", add_special_tokens=False)

    async def main() -> list[Sample]:
        engine = FakeEngine(script)
        async with GenerateClient(
            engine.url, [engine.url], None, 30.0, 8, transport=engine.transport
        ) as client:
            outs = []
            for i, fn in enumerate((_agent_ok, _agent_raises, _agent_hangs)):
                ctx = GenerateContext(tok, "rollout7", agent=AgentSettings(fn, fn.__name__, timeout=1.0))
                outs.append(generate_with_agent(client, Sample(index=i, tokens=list(prompt)), SAMPLING, ctx))
            samples = await asyncio.gather(*outs)
            assert client.on_close  # the session server stops with the client
        return samples

    ok, raised, hung = asyncio.run(main())
    assert ok.status == SampleStatus.COMPLETED and ok.reward == 1.0 and ok.check_consistent() is None
    assert ok.loss_mask == [1] * ok.response_length and ok.response == "Hello 0"
    assert ok.metadata["session"]["leaves"] == 1
    assert raised.status == SampleStatus.FAILED and raised.reward == 0.0
    assert "the agent's bug" in raised.metadata["agent_error"] and raised.response_length > 0
    assert hung.status == SampleStatus.FAILED and hung.reward == 0.0 and hung.response_length == 0
    assert "--agent-timeout" in hung.metadata["agent_error"]


def test_the_openai_agent_example_runs_a_tool_episode() -> None:
    from examples.openai_agent.agent import run

    script = Script()
    tok = script.tok
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]
    ids = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)

    async def main() -> Sample:
        engine = FakeEngine(script)
        async with GenerateClient(
            engine.url, [engine.url], None, 30.0, 8, transport=engine.transport
        ) as client:
            ctx = GenerateContext(tok, "rollout0", agent=AgentSettings(run, "example", timeout=30.0))
            sample = Sample(index=0, prompt=prompt, tokens=list(ids), label="42")
            return await generate_with_agent(client, sample, SAMPLING, ctx)

    sample = asyncio.run(main())
    assert sample.reward == 1.0 and sample.metadata["session"]["turns"] == 2
    trained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert trained == script.sampled[0] + script.sampled[1]
    assert sample.rollout_log_probs is not None and sample.check_consistent() is None


def test_streamed_tool_episode_records_the_same_tokens_as_non_streaming() -> None:
    """`stream=True` with tools: the SDK's chunk models parse the role, tool-call and finish chunks and the
    `[DONE]` end; the session records token for token what the same non-streamed episode records."""

    async def episode(server: SessionServer, sid: str, stream: bool):  # noqa: ANN202
        rec = server.open(sid)
        async with openai.AsyncOpenAI(base_url=server.base_url(sid), api_key=server.api_key) as oai:
            messages: list = [{"role": "user", "content": "What is 12 + 30?"}]
            for _ in range(2):
                kwargs = {"model": "m", "messages": messages, "tools": CALC_TOOLS}
                if not stream:
                    msg = (await oai.chat.completions.create(**kwargs)).choices[0].message.model_dump()
                else:
                    msg, finishes, chunks = {"role": "assistant", "content": ""}, [], 0
                    calls: dict[int, dict] = {}
                    async for chunk in await oai.chat.completions.create(**kwargs, stream=True):
                        assert chunk.object == "chat.completion.chunk"
                        chunks += 1
                        for c in chunk.choices:
                            msg["content"] += c.delta.content or ""
                            finishes += [c.finish_reason] if c.finish_reason else []
                            for tc in c.delta.tool_calls or []:
                                calls[tc.index] = {
                                    "id": tc.id,
                                    "type": "function",
                                    "function": tc.function.model_dump(),
                                }
                    assert len(finishes) == 1 and chunks >= 3
                    assert finishes[0] == ("tool_calls" if calls else "stop")
                    if calls:
                        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
                messages.append(msg)
                if not msg.get("tool_calls"):
                    return rec, msg["content"]
                call = msg["tool_calls"][0]
                assert json.loads(call["function"]["arguments"]) == {"expression": "12 + 30"}
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
        return rec, None

    async def body(server: SessionServer):  # noqa: ANN202
        return await episode(server, "plain", False), await episode(server, "streamed", True)

    _, ((plain, text1), (streamed, text2)) = _run(body)
    assert text1 == text2 == "The answer is 42."
    [a], [b] = plain.leaves(), streamed.leaves()
    assert (a.tokens, a.loss_mask, a.log_probs) == (b.tokens, b.loss_mask, b.log_probs)
    assert len(b.turns) == 2 and streamed.lineages == 1


def test_sse_stream_ends_with_done() -> None:
    async def body(server: SessionServer):  # noqa: ANN202
        server.open("raw")
        headers = {"Authorization": f"Bearer {server.api_key}"}
        req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{server.base_url('raw')}/chat/completions", json=req, headers=headers)
        return r.headers["content-type"], r.text

    ctype, text = _run(body)[1]
    events = [e for e in text.split("\n\n") if e]
    assert ctype.startswith("text/event-stream") and all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "stop" and last["object"] == "chat.completion.chunk"


async def _agent_no_reward(base_url: str, sample: Sample, ctx) -> None:  # noqa: ANN001
    await _agent_ok(base_url, sample, ctx)
    return None


@pytest.mark.parametrize("has_reward_fn", [True, False])
def test_an_agent_returning_none_needs_a_reward_function(has_reward_fn: bool) -> None:
    script = Script()
    prompt = script.tok.encode("hi", add_special_tokens=False)

    async def main() -> Sample:
        engine = FakeEngine(script)
        async with GenerateClient(
            engine.url, [engine.url], None, 30.0, 8, transport=engine.transport
        ) as client:
            agent = AgentSettings(_agent_no_reward, "m:none", timeout=5.0, has_reward_fn=has_reward_fn)
            ctx = GenerateContext(script.tok, "rollout0", agent=agent)
            return await generate_with_agent(client, Sample(index=3, tokens=list(prompt)), SAMPLING, ctx)

    sample = asyncio.run(main())
    if has_reward_fn:  # the reward function scores it later
        assert sample.status == SampleStatus.COMPLETED and sample.reward is None
    else:  # that sample fails, naming the flags; the tokens stay
        assert sample.status == SampleStatus.FAILED and sample.reward == 0.0 and sample.response == "Hello 0"
        error = sample.metadata["agent_error"]
        assert "--agent-function-path" in error and "--custom-rm-path" in error and "index 3" in error


def test_the_compacting_agent_example_yields_a_tree_with_one_sample_per_leaf() -> None:
    from examples.openai_agent.compacting import run
    from miles.rollout.session.picking import build_samples

    script = Script()
    tok = script.tok
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]

    async def main(server: SessionServer):  # noqa: ANN202
        rec = server.open("compact")
        sample = Sample(index=0, prompt=prompt, label="42")
        actx = type("Ctx", (), {"api_key": server.api_key})()
        got = await run(server.base_url("compact"), sample, actx)
        server.close("compact")
        return got, rec, build_samples(rec, sample)

    reward, rec, samples = asyncio.run(_serving(script, main))
    # the call (tools offered), then the compacted question (no tools): two lineages, two leaves
    assert reward == 0.7 and len(script.sampled) == 2  # the fake answers "Hello 0": called + a number
    assert len(rec.leaves()) == 2 and rec.lineages == 2
    assert len(samples) == 2  # most recent leaf first: the answer after the compaction, then the call
    for sample, sampled, inputs in zip(samples, script.sampled[::-1], script.inputs[::-1]):
        # each leaf: the prompt it was sampled from, then the sampled tokens, all of them trained once
        assert sample.tokens == inputs + sampled and sample.response_length == len(sampled)
        assert sample.loss_mask == [1] * len(sampled) and sample.check_consistent() is None
    assert "calc says 42" in tok.decode(samples[0].tokens) and "<tool_call>" in tok.decode(samples[1].tokens)
