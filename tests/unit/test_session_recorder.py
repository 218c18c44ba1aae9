"""The session recorder (token-in, token-out) and the chat helpers, without a server: pure Python."""

from __future__ import annotations

import pytest

from miles.rollout.session.chat import normalize_messages, parse_tool_calls, turn_text
from miles.rollout.session.recorder import Session, TurnRecord, to_sample
from miles.utils.types import Sample, SampleStatus
from tests.session_helpers import char_ids, qwen_style_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 + 30"}}\n</tool_call>'


def _turn(session: Session, messages: list[dict], text: str, tools=TOOLS, eos: bool = True):
    """Prepare a request, 'sample' `text` one token per character, record it; (prepared, node, sampled ids)."""
    tok = session.tokenizer
    msgs = normalize_messages(messages)
    prepared = session.prepare(msgs, tools)
    out = char_ids(tok, text) + ([tok.eos_token_id] if eos else [])
    lps = [-0.1 * (i + 1) for i in range(len(out))]
    parsed = parse_tool_calls(turn_text(tok, out), bool(tools))
    node = session.record(
        prepared, msgs, parsed.message(), TurnRecord(prepared.input_ids, out, lps, "3", "stop")
    )
    return prepared, node, out, parsed


def _episode_start(session: Session):
    user = [{"role": "user", "content": "What is 12 + 30?"}]
    _, node, out, parsed = _turn(session, user, CALL)
    echoed = {  # what the OpenAI SDK sends back: arguments as a JSON string, an id, extra fields
        "role": "assistant",
        "content": parsed.content,
        "refusal": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calc", "arguments": '{"expression": "12 + 30"}'},
            }
        ],
    }
    return user, node, out, echoed


def test_parse_tool_calls_qwen_json_and_bad_json_stays_content() -> None:
    turn = parse_tool_calls("let me see " + CALL, with_tools=True)
    assert turn.content == "let me see"
    assert turn.tool_calls == [{"name": "calc", "arguments": {"expression": "12 + 30"}}]
    bad = parse_tool_calls("<tool_call>{not json</tool_call>", with_tools=True)
    assert bad.tool_calls == [] and bad.content == "<tool_call>{not json</tool_call>"
    assert parse_tool_calls(CALL, with_tools=False).tool_calls == []


def test_multi_turn_append_keeps_sampled_tokens_and_masks_tool_tokens() -> None:
    tok = qwen_style_tokenizer()
    s = Session("s", tok)
    user, first, out1, echoed = _episode_start(s)
    # the model's split is not the tokenizer's: re-tokenizing the sampled text would change the ids
    assert tok.encode(tok.decode(out1), add_special_tokens=False) != out1
    history = [*user, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    prepared, second, out2, _ = _turn(s, history, "The answer is 42.")
    assert prepared.parent is first
    assert prepared.input_ids[: len(first.tokens)] == first.tokens  # the held prefix, token for token
    added = prepared.input_ids[len(first.tokens) :]
    assert (
        tok.decode(added)
        == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    p = first.prompt_len
    assert second.tokens == prepared.input_ids + out2
    assert second.tokens[p : p + len(out1)] == out1
    assert second.loss_mask == [1] * len(out1) + [0] * len(added) + [1] * len(out2)
    assert second.log_probs[: len(out1)] == pytest.approx([-0.1 * (i + 1) for i in range(len(out1))])
    assert second.log_probs[len(out1) : len(out1) + len(added)] == [0.0] * len(added)
    assert [t.output_ids for t in second.turns] == [out1, out2]
    assert s.leaves() == [second] and s.lineages == 1


def test_turn_without_eos_is_closed_with_the_eos_token() -> None:
    tok = qwen_style_tokenizer()
    s = Session("s", tok)
    user = [{"role": "user", "content": "What is 12 + 30?"}]
    _, node, out, parsed = _turn(s, user, "The answer", tools=None, eos=False)
    assert not node.ends_with_eos
    history = [*user, parsed.message(), {"role": "user", "content": "and?"}]
    prepared = s.prepare(normalize_messages(history), None)
    assert prepared.input_ids[len(node.tokens)] == tok.eos_token_id
    assert prepared.loss_mask[len(out)] == 0


def test_edited_history_branches_and_each_leaf_is_a_sample() -> None:
    tok = qwen_style_tokenizer()
    s = Session("s", tok)
    user, first, out1, echoed = _episode_start(s)
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    _, second, _, parsed2 = _turn(s, [*user, echoed, tool], "The answer is 42.")
    # the agent drops the tool answer and asks again after its first turn: a branch from the first node
    retry = [*user, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "error, retry"}]
    prepared, third, _, _ = _turn(s, retry, "12")
    assert prepared.parent is first
    # the agent compacts its history (a rewritten assistant turn): a new lineage branching off the first node
    # where the tokens part (right after the shared prompt: the sampled tool call is not what was rewritten)
    compacted = [
        *user,
        {"role": "assistant", "content": "I computed 42."},
        {"role": "user", "content": "sure?"},
    ]
    prepared4, fourth, out4, _ = _turn(s, compacted, "yes")
    assert prepared4.parent is None and (fourth.branch_of, fourth.fork_at) == (first.id, first.prompt_len)
    assert fourth.prompt_len == first.prompt_len
    assert fourth.loss_mask == [0] * (len(prepared4.input_ids) - first.prompt_len) + [1] * len(out4)
    assert s.leaves() == [second, third, fourth] and s.lineages == 2
    sample = to_sample(third, Sample(index=5, tokens=[1, 2, 3]))
    assert sample.check_consistent() is None
    assert sample.tokens == third.tokens and sample.response_length == len(third.tokens) - first.prompt_len
    assert sum(sample.loss_mask) == len(out1) + len(third.turns[-1].output_ids)
    assert sample.status == SampleStatus.COMPLETED and sample.weight_versions == ["3", "3"]


def test_n_siblings_and_the_agent_continues_the_chosen_one() -> None:
    tok = qwen_style_tokenizer()
    s = Session("s", tok)
    user = normalize_messages([{"role": "user", "content": "What is 12 + 30?"}])
    prepared = s.prepare(user, None)
    nodes = []
    for text in ("42", "43"):
        out = char_ids(tok, text) + [tok.eos_token_id]
        turn = parse_tool_calls(text, False)
        nodes.append(
            s.record(
                prepared,
                user,
                turn.message(),
                TurnRecord(prepared.input_ids, out, [0.0] * len(out), None, "stop"),
            )
        )
    history = normalize_messages(
        [*user, {"role": "assistant", "content": "43"}, {"role": "user", "content": "sure?"}]
    )
    assert s.prepare(history, None).parent is nodes[1]
