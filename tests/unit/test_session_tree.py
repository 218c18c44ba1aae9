"""Edited histories as a tree (issue 26): branches at the longest common token prefix, the default sample picker
(superseded retries dropped) and post-processor (exactly-once completion masking), with exact masks.

A character tokenizer (one token per character, "$" the EOS) makes every mask writable by hand: a message
renders as `<role initial>:<content>$`, the generation prompt as `a:`.
"""

from __future__ import annotations

import pytest

from miles.rollout.session.chat import normalize_messages
from miles.rollout.session.picking import build_samples, mask_exactly_once, pick_leaves, superseded
from miles.rollout.session.recorder import Session, TurnRecord
from miles.utils.types import Sample
from tests.session_helpers import CharTok


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def turn(s: Session, history: list[tuple[str, str]], *sampled: str):  # noqa: ANN201
    """One request of `history` ((role, content) pairs) 'sampling' each of `sampled` (n choices)."""
    msgs = normalize_messages([{"role": r, "content": c} for r, c in history])
    prepared = s.prepare(msgs, None)
    nodes = []
    for text in sampled:
        out = ids(text + "$")
        msg = {"role": "assistant", "content": text}
        nodes.append(
            s.record(prepared, msgs, msg, TurnRecord(prepared.input_ids, out, [-0.5] * len(out), "1", "stop"))
        )
    return prepared, nodes


def test_dropped_turn_and_compaction_make_a_tree_with_exact_masks() -> None:
    s = Session("t", CharTok())
    q = [("user", "q")]
    _, [n0] = turn(s, q, "x=1")  # input "u:q$a:" (6 tokens), sampled "x=1$"
    assert (n0.prompt_len, n0.loss_mask, n0.owners) == (6, [1] * 4, [0] * 4)
    _, [n1] = turn(s, [*q, ("assistant", "x=1"), ("tool", "1")], "ok")
    assert n1.parent == 0 and n1.tokens == ids("u:q$a:x=1$t:1$a:ok$")
    assert n1.loss_mask == [1] * 4 + [0] * 6 + [1] * 3
    # dropped turn: the agent discards the tool answer and asks something else after its first turn
    _, [n2] = turn(s, [*q, ("assistant", "x=1"), ("user", "why")], "so")
    assert n2.parent == 0 and n2.loss_mask == [1] * 4 + [0] * 8 + [1] * 3
    # compaction: the first assistant turn rewritten; the tokens agree with n0's through "x=1" (9 tokens)
    p3, [n3] = turn(s, [*q, ("assistant", "x=1 (short)"), ("user", "go")], "done")
    assert p3.parent is None and (n3.branch_of, n3.fork_at, n3.prompt_len) == (0, 9, 6)
    assert n3.tokens == ids("u:q$a:x=1 (short)$u:go$a:done$")
    assert n3.loss_mask == [1] * 3 + [0] * len(" (short)$u:go$a:") + [1] * 5
    assert n3.log_probs[:3] == [-0.5] * 3 and n3.owners[:4] == [0, 0, 0, -1]
    assert [n.id for n in s.leaves()] == [1, 2, 3] and s.lineages == 2 and n0.children == 2
    assert s.tree()[3]["branch_of"] == 0 and not s.tree()[0]["leaf"]

    picked = pick_leaves(s)
    assert [n.id for n in picked] == [3, 2, 1]  # most recent first
    samples = build_samples(s, Sample(index=0, tokens=ids("u:q$a:"), label="1"))
    # exactly once: "x=1" trained in n3's sample, n0's "$" in n2's, n1 keeps only its own turn
    assert samples[0].loss_mask == n3.loss_mask
    assert samples[1].loss_mask == [0, 0, 0, 1] + [0] * 8 + [1] * 3
    assert samples[2].loss_mask == [0] * 4 + [0] * 6 + [1] * 3
    assert all(x.check_consistent() is None and x.label == "1" for x in samples)
    trained = sorted(
        (o, 6 + i) for x, n in zip(samples, picked) for i, o in enumerate(n.owners) if x.loss_mask[i]
    )
    sampled = sorted({(o, 6 + i) for n in picked for i, o in enumerate(n.owners) if o >= 0})
    assert trained == sampled  # every sampled token of the picked leaves, each once


def test_a_retry_of_the_same_prompt_supersedes_the_earlier_leaf_but_n_siblings_stay() -> None:
    s = Session("t", CharTok())
    q = [("user", "q")]
    _, [a, b] = turn(s, q, "1", "2")  # n = 2: siblings of one request
    assert superseded(s) == set()
    p, [c] = turn(s, q, "3")  # the agent sends the same prompt again
    assert p.input_ids == a.turns[-1].prompt_ids and (c.branch_of, c.fork_at, c.prompt_len) == (0, 6, 6)
    assert c.loss_mask == [1, 1] and superseded(s) == {a.id, b.id}
    assert [n.id for n in pick_leaves(s)] == [c.id]
    # continuing the retried answer keeps the retry's lineage; the earlier leaves stay dropped
    _, [d] = turn(s, [*q, ("assistant", "3"), ("user", "more")], "4")
    assert d.parent == c.id and [n.id for n in pick_leaves(s)] == [d.id]


def test_the_postprocessor_keeps_masks_of_disjoint_leaves_and_checks_lengths() -> None:
    s = Session("t", CharTok())
    _, [a] = turn(s, [("user", "q")], "1")
    _, [b] = turn(s, [("user", "other")], "2")  # a different prompt: a new root, nothing shared
    assert b.branch_of is None and b.prompt_len == len(b.turns[-1].prompt_ids)
    samples = build_samples(s, Sample(index=0))
    assert [x.loss_mask for x in samples] == [[1, 1], [1, 1]]
    with pytest.raises(ValueError, match="shorter"):
        mask_exactly_once(samples, [a])
    with pytest.raises(ValueError, match="picker returned dict"):
        build_samples(s, Sample(index=0), pick=lambda session: {})


BASE = "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 --global-batch-size 4 --colocate"
AGENT = " --use-session-server --agent-function-path examples.openai_agent.agent:run"


def test_hook_flags_are_checked_at_start_up() -> None:
    from miles.config import ConfigError, parse_config
    from miles.rollout.seams import load_seams

    with pytest.raises(ConfigError) as info:
        parse_config((BASE + " --session-sample-picker-path a.b:pick").split())
    assert any(
        "--session-sample-picker-path" in v and "add --use-session-server" in v for v in info.value.violations
    )
    with pytest.raises(ConfigError) as info:
        parse_config((BASE + AGENT + " --session-sample-postprocessor-path nocolon").split())
    assert any("--session-sample-postprocessor-path='nocolon'" in v for v in info.value.violations)
    hooks = " --session-sample-picker-path miles.rollout.session.picking:pick_leaves"
    hooks += " --session-sample-postprocessor-path miles.rollout.session.picking:mask_exactly_once"
    cfg = parse_config((BASE + AGENT + hooks).split())
    agent = load_seams(cfg.rollout, cfg.eval).agent
    assert agent is not None and agent.pick is pick_leaves and agent.postprocess is mask_exactly_once
    assert (
        load_seams(*(lambda c: (c.rollout, c.eval))(parse_config((BASE + AGENT).split()))).agent.pick is None
    )
    bad = parse_config((BASE + AGENT + " --session-sample-postprocessor-path json:dumps").split())
    with pytest.raises(ValueError, match="--session-sample-postprocessor-path='json:dumps'"):
        load_seams(bad.rollout, bad.eval)  # json.dumps(obj, *, ...) takes one positional argument, not two
