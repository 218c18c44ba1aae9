"""The stock multi-turn generate function against a fake engine: tool calls, masks, errors, limits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from examples.calculator.build import TOOL_TOKENS, corpus
from examples.calculator.tool import calculator, calculator_reward
from miles.rollout.base_types import GenerateContext, MultiTurnSettings, SamplingSettings
from miles.rollout.generate_client import GenerateClient
from miles.rollout.multi_turn import ToolTimeoutError, generate_multi_turn, parse_tool_call
from miles.rollout.rm_hub import RewardContext
from miles.utils.types import Sample, SampleStatus
from tests.fake_engine import FakeEngine, Reply, log_prob_of


@pytest.fixture(scope="module")
def tok():
    from miles.tools.tiny_model import build_tokenizer

    return build_tokenizer("echo10", 64, extra_texts=corpus(), extra_special_tokens=TOOL_TOKENS)


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ("<tool_call>7 + 6</tool_call>", "7 + 6"),
        ("let me see <tool_call> 2*3 ", "2*3"),  # no closing tag: up to the end of the turn
        ("<tool_call>1</tool_call> then <tool_call>2 + 2</tool_call>", "2 + 2"),  # the last call
        ("<tool_call><|im_end|>", ""),
        ("13", None),
    ],
)
def test_parse_tool_call(text: str, arguments: str | None) -> None:
    assert parse_tool_call(text, "<|im_end|>") == arguments


def run(tok, engine: FakeEngine, sample: Sample, tool=calculator, max_turns: int = 4, budget: int = 40,
        timeout: float = 5.0) -> Sample:  # fmt: skip
    settings = MultiTurnSettings(max_turns=max_turns, tool=tool, tool_timeout=timeout, tool_name="the_tool")
    ctx = GenerateContext(tokenizer=tok, request_id_prefix="rollout3", multi_turn=settings)
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=budget)

    async def go() -> Sample:
        async with GenerateClient(
            engine.url, [engine.url], None, 30.0, 8, transport=engine.transport
        ) as client:
            return await generate_multi_turn(client, sample, sampling, ctx)

    return asyncio.run(go())


def prompt(tok, text: str = "calc 7 + 6") -> Sample:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return Sample(index=5, tokens=tok(ids, add_special_tokens=False)["input_ids"], label="13",
                  metadata={"expression": text.removeprefix("calc ")})  # fmt: skip


def scripted(tok, turns: list[str]):
    """A fake engine answering the i-th request of a sample with `turns[i]` (ending the turn as the engine would)."""

    def respond(ids, sp, rid):
        i = 0 if "-t" not in rid else int(rid.rsplit("-t", 1)[1])
        text = turns[min(i, len(turns) - 1)]
        return Reply(tok(text, add_special_tokens=False)["input_ids"], text=text)

    return respond


def test_tool_call_round_trip_masks_the_tool_answer(tok):
    engine = FakeEngine(scripted(tok, ["<tool_call>7 + 6</tool_call>", "13<|im_end|>"]))
    sample = run(tok, engine, prompt(tok))
    assert sample.status == SampleStatus.COMPLETED
    assert sample.metadata["turns"] == 2 and sample.metadata["tool_calls"] == 1
    assert sample.metadata["final_turn"] == "13<|im_end|>"
    call = tok("<tool_call>7 + 6</tool_call>", add_special_tokens=False)["input_ids"]
    answer = tok(
        "<|im_end|>\n<|im_start|>tool\n13<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )["input_ids"]
    final = tok("13<|im_end|>", add_special_tokens=False)["input_ids"]
    assert sample.response_ids == call + answer + final
    assert sample.loss_mask == [1] * len(call) + [0] * len(answer) + [1] * len(final)
    expected_lp = [log_prob_of(t, i) for i, t in enumerate(call)] + [0.0] * len(answer)
    expected_lp += [log_prob_of(t, i) for i, t in enumerate(final)]
    assert sample.rollout_log_probs == expected_lp and sample.check_consistent() is None
    first, second = engine.requests
    assert first["rid"] == "rollout3-5" and second["rid"] == "rollout3-5-t1"
    assert (
        second["input_ids"] == sample.tokens[: sample.prompt_length] + call + answer
    )  # the conversation so far
    assert first["sampling_params"]["max_new_tokens"] == 40
    assert second["sampling_params"]["max_new_tokens"] == 40 - len(call) - len(answer)
    assert "</tool_call>" in first["sampling_params"]["stop"]
    assert sample.weight_versions == ["0", "0"]
    assert calculator_reward(RewardContext(), sample) == 1.0
    sample.metadata["final_turn"] = "12<|im_end|>"
    assert calculator_reward(RewardContext(), sample) == 0.7  # used the tool, answered wrongly


def test_tool_error_is_the_answer_and_a_hanging_tool_fails_in_time(tok):
    def broken(arguments, sample):
        raise ValueError("no")

    engine = FakeEngine(scripted(tok, ["<tool_call>1 + 1</tool_call>", "2<|im_end|>"]))
    sample = run(tok, engine, prompt(tok), tool=broken, budget=80)
    assert (
        "tool\nerror: ValueError: no<|im_end|>" in sample.response and sample.status == SampleStatus.COMPLETED
    )

    ended = threading.Event()

    def hangs(arguments, sample):
        threading.Event().wait(60)
        ended.set()

    with pytest.raises(ToolTimeoutError, match=r"rollout generate \(rollout3\): tool the_tool gave no answer within "
                       r"0.3s .*sample index 5"):  # fmt: skip
        run(
            tok,
            FakeEngine(scripted(tok, ["<tool_call>1 + 1</tool_call>"])),
            prompt(tok),
            tool=hangs,
            timeout=0.3,
        )
    assert not ended.is_set()  # the rollout gave up on the tool, it did not wait for it


def test_turn_limit_and_budget(tok):
    always_calls = FakeEngine(scripted(tok, ["<tool_call></tool_call>"]))
    sample = run(tok, always_calls, prompt(tok), max_turns=3)
    assert sample.status == SampleStatus.TRUNCATED
    assert sample.metadata["turns"] == 3 and sample.metadata["tool_calls"] == 2
    assert calculator_reward(RewardContext(), sample) == 0.4  # called the tool, never answered

    tight = run(tok, FakeEngine(scripted(tok, ["<tool_call>7 + 6</tool_call>"])), prompt(tok), budget=8)
    assert tight.status == SampleStatus.TRUNCATED and tight.response_length == 8  # the tool answer was cut
    assert tight.check_consistent() is None
