"""The session server in front of a real embedded engine (a tiny random Qwen3), driven by the official `openai` SDK.

A three-turn tool episode (the tools rendered by a Qwen3-style chat template, a tool answer and a user turn
between the assistant turns). The session's leaf must hold, token for token, each request's prompt ids followed
by what the engine sampled, the engine's log-probs at every sampled token, and the trainer's packed forward
(`pack_sequences` + `forward_packed`, fp32 on CPU) must give those log-probs within 1e-5.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from miles.rollout.base_types import SamplingSettings
from miles.rollout.generate_client import GenerateClient
from miles.rollout.generate_output import GenerateOutput
from miles.rollout.session.recorder import to_sample
from miles.rollout.session.server import SessionServer
from miles.utils.types import Sample
from tests.session_helpers import CALC_TOOLS, CORPUS, QWEN_STYLE_TEMPLATE, TOOL_CALL_TOKENS

pytestmark = pytest.mark.slow

SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=400)
TURN_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model

    # the tokenizer of tests.session_helpers.qwen_style_tokenizer (same corpus, specials and size)
    out = tmp_path_factory.mktemp("session_real") / "model"
    return str(
        build_tiny_model(
            out, seed=0, vocab_size=260, extra_texts=CORPUS, extra_special_tokens=TOOL_CALL_TOKENS
        )
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    from miles.engines.sglang_engine import EngineProcess

    with EngineProcess(model_dir, kind="local", startup_timeout=120, local_args={"num-threads": 1}) as eng:
        yield eng


class Recording(GenerateClient):
    """The generate client, keeping every (input ids, engine output) pair as the server received it."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[list[int], GenerateOutput]] = []

    async def generate(self, input_ids, sampling_params, sample_index, phase, rid=None) -> GenerateOutput:  # noqa: ANN001
        out = await super().generate(input_ids, sampling_params, sample_index, phase, rid=rid)
        self.seen.append((list(input_ids), out))
        return out


async def _episode(url: str, tokenizer) -> tuple[list, object]:  # noqa: ANN001
    async with Recording(url, [url], None, 120.0, 4) as client:
        server = SessionServer(client, tokenizer, SAMPLING)
        await server.start()
        try:
            rec = server.open("real")
            async with openai.AsyncOpenAI(base_url=server.base_url("real"), api_key=server.api_key) as oai:
                messages: list = [{"role": "user", "content": "What is 12 + 30? Use the calculator."}]
                follow_ups = [
                    {"role": "tool", "tool_call_id": "call_0", "content": "42"},
                    {"role": "user", "content": "The answer is 42. Tools?"},
                    None,
                ]
                for extra in follow_ups:
                    answer = await oai.chat.completions.create(
                        model="m", messages=messages, tools=CALC_TOOLS, logprobs=True, max_tokens=TURN_TOKENS
                    )
                    choice = answer.choices[0]
                    assert answer.usage.completion_tokens == len(choice.logprobs.content) > 0
                    messages.append(choice.message.model_dump(exclude_none=True))
                    if extra is not None:
                        messages.append(extra)
        finally:
            await server.stop()
        return client.seen, rec


def test_leaf_is_what_the_engine_sampled_and_what_the_trainer_scores(model_dir, engine) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.backends.fsdp_utils.data_packing import pack_sequences
    from miles.backends.fsdp_utils.forward import forward_packed

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = QWEN_STYLE_TEMPLATE
    seen, rec = asyncio.run(_episode(engine.url, tok))

    assert len(seen) == 3 and rec.lineages == 1  # every request extended the session: one lineage
    [leaf] = rec.leaves()
    assert "# Tools" in tok.decode(leaf.tokens[: leaf.prompt_len])  # the template rendered the tools
    # (a) the leaf is each request's prompt followed by the engine's output, token for token
    assert [t.prompt_ids for t in leaf.turns] == [ids for ids, _ in seen]
    assert [t.output_ids for t in leaf.turns] == [out.output_ids for _, out in seen]
    for k, (ids, out) in enumerate(seen):
        end = len(ids) + len(out.output_ids)
        assert leaf.tokens[:end] == ids + out.output_ids
        if k + 1 < len(seen):  # the next prompt extends it as held, sampled ids not re-tokenized
            assert seen[k + 1][0][:end] == ids + out.output_ids
    assert leaf.tokens == seen[-1][0] + seen[-1][1].output_ids
    sampled = [out.output_ids for _, out in seen]  # a random policy samples splits re-tokenizing would merge
    assert any(tok.encode(tok.decode(ids), add_special_tokens=False) != ids for ids in sampled)
    # (b) loss mask 1 exactly at the sampled tokens, which carry the engine's log-probs
    mask = [0] * leaf.response_length
    engine_lp = [0.0] * leaf.response_length
    for ids, out in seen:
        start = len(ids) - leaf.prompt_len
        assert out.log_probs is not None and len(out.log_probs) == len(out.output_ids)
        for j, lp in enumerate(out.log_probs):
            mask[start + j], engine_lp[start + j] = 1, lp
    assert leaf.loss_mask == mask and leaf.log_probs == engine_lp
    assert sum(mask) == sum(len(out.output_ids) for _, out in seen) < leaf.response_length

    # (c) the trainer's packed forward of the leaf's sample scores the trained tokens as the engine did
    sample = to_sample(leaf, Sample(index=0))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    (packed,) = pack_sequences([sample], 1)
    with torch.no_grad():
        (trainer_lp,), _ = forward_packed(model, packed, temperature=SAMPLING.temperature)
    trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
    rollout_lp = torch.tensor(sample.rollout_log_probs)
    worst = float((trainer_lp[trained] - rollout_lp[trained]).abs().max())
    print(f"trained tokens {int(trained.sum())}, max |trainer - engine log-prob| {worst:.3g}")
    assert worst <= 1e-5, worst
    assert bool((rollout_lp[~trained] == 0.0).all())
