"""A session whose engine dies mid-episode resumes on another engine (issue 26 item 5, fault tolerance).

Two real embedded engines serve the same tiny Qwen3-style model; a three-turn tool episode runs through the session
server with the official `openai` SDK. The engine that takes the second turn is frozen (SIGSTOP) before the request
reaches it, so the request is in flight, then killed (SIGKILL): the connection drops, the generate client sets that
engine aside and re-sends the same payload, the session's exact token prefix, to the other engine. Nothing the dead
engine may have sampled is recorded: the turn is the surviving engine's complete sample. The leaf must still be
each request's prompt followed by the answering engine's output, token for token, with its log-probs.
"""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest

from miles.rollout.base_types import SamplingSettings
from miles.rollout.generate_client import GenerateClient
from miles.rollout.session.server import SessionServer
from tests.session_helpers import CALC_TOOLS, CORPUS, QWEN_STYLE_TEMPLATE, TOOL_CALL_TOKENS

pytestmark = pytest.mark.slow

SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=400)


@pytest.fixture
def two_session_engines(tmp_path):
    from miles.engines.sglang_engine import EngineProcess
    from miles.tools.tiny_model import build_tiny_model

    model_dir = str(
        build_tiny_model(
            tmp_path / "model",
            seed=0,
            vocab_size=260,
            extra_texts=CORPUS,
            extra_special_tokens=TOOL_CALL_TOKENS,
        )
    )
    procs = [
        EngineProcess(model_dir, kind="local", startup_timeout=120, local_args={"num-threads": 1})
        for _ in range(2)
    ]
    try:
        for p in procs:
            p.launch()
        yield model_dir, procs
    finally:
        for p in procs:
            p.shutdown()


class KillsAnEngine(GenerateClient):
    """The generate client, killing the engine that takes generation number `kill_at` while it holds it; every
    /generate attempt is kept as (engine URL, input ids, answered)."""

    def __init__(self, procs, kill_at: int, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.procs = {p.url.rstrip("/"): p for p in procs}
        self.kill_at = kill_at
        self.attempts: list[tuple[str, list[int], bool]] = []
        self.killed: str | None = None

    async def post(self, url, body, phase, what="", retry=True, timeout=None, deadline=None):  # noqa: ANN001, ANN201
        if not url.endswith("/generate"):
            return await super().post(url, body, phase, what, retry, timeout, deadline)
        engine = url.removesuffix("/generate")
        self.attempts.append((engine, list(body["input_ids"]), False))
        if len(self.attempts) != self.kill_at:
            out = await super().post(url, body, phase, what, retry, timeout, deadline)
            self.attempts[-1] = (engine, self.attempts[-1][1], True)
            return out
        proc = self.procs[engine]
        os.killpg(proc.pid, signal.SIGSTOP)  # the engine accepts the connection but never answers
        sent = asyncio.ensure_future(super().post(url, body, phase, what, retry, timeout, deadline))
        await asyncio.sleep(1.0)
        assert not sent.done()  # in flight on the frozen engine
        await asyncio.to_thread(proc.kill)
        self.killed = engine
        return await sent  # the dropped connection: EngineUnavailable, and the client tries the other engine


async def _episode(procs, tokenizer) -> tuple[KillsAnEngine, object]:  # noqa: ANN001
    urls = [p.url for p in procs]
    async with KillsAnEngine(procs, 2, urls[0], urls, None, 120.0, 4) as client:
        server = SessionServer(client, tokenizer, SAMPLING)
        await server.start()
        try:
            rec = server.open("dies")
            async with openai.AsyncOpenAI(
                base_url=server.base_url("dies"), api_key=server.api_key, max_retries=0
            ) as oai:
                messages: list = [{"role": "user", "content": "What is 12 + 30? Use the calculator."}]
                follow_ups = [
                    {"role": "tool", "tool_call_id": "call_0", "content": "42"},
                    {"role": "user", "content": "The answer is 42. Tools?"},
                    None,
                ]
                for extra in follow_ups:
                    answer = await oai.chat.completions.create(
                        model="m", messages=messages, tools=CALC_TOOLS, logprobs=True, max_tokens=12
                    )
                    messages.append(answer.choices[0].message.model_dump(exclude_none=True))
                    if extra is not None:
                        messages.append(extra)
        finally:
            await server.stop()
        return client, rec


def test_a_turn_in_flight_on_a_killed_engine_is_resent_from_the_exact_prefix(two_session_engines) -> None:
    from transformers import AutoTokenizer

    model_dir, procs = two_session_engines
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = QWEN_STYLE_TEMPLATE
    client, rec = asyncio.run(_episode(procs, tok))

    dead = client.killed
    assert dead is not None and client._set_aside == {client.engine_urls.index(dead)}
    engines = [e for e, _, _ in client.attempts]
    answered = [(e, ids) for e, ids, ok in client.attempts if ok]
    # turn 1 answered; turn 2 sent to the engine that died, then re-sent whole to the other; turn 3 there too
    assert len(client.attempts) == 4 and [ok for *_, ok in client.attempts] == [True, False, True, True]
    assert engines[1] == dead and engines[2] != dead and engines[3] != dead
    assert client.attempts[1][1] == client.attempts[2][1]  # the same token prefix, not re-rendered
    assert rec.lineages == 1 and rec.requests == 3
    [leaf] = rec.leaves()
    assert [t.prompt_ids for t in leaf.turns] == [ids for _, ids in answered]
    mask, lps = [0] * leaf.response_length, [0.0] * leaf.response_length
    for t in leaf.turns:  # each prompt extends what the session held; the turn is one engine's whole sample
        end = len(t.prompt_ids) + len(t.output_ids)
        assert leaf.tokens[:end] == t.prompt_ids + t.output_ids and len(t.log_probs) == len(t.output_ids) > 0
        start = len(t.prompt_ids) - leaf.prompt_len
        mask[start : start + len(t.output_ids)] = [1] * len(t.output_ids)
        lps[start : start + len(t.output_ids)] = t.log_probs
    assert leaf.loss_mask == mask and leaf.log_probs == lps
