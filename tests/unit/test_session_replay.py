"""Replay debugging of agent sessions (issue 26 item 5): `--save-debug-rollout-data` stores each session sample
with its tree (lineage and leaf ids, per-turn weight versions, masks, owners' exactly-once masking), and
`--load-debug-rollout-data` reads back the same samples the trainer received, bit for bit.

The session is the compaction tree of test_session_tree, built with a character tokenizer and turns sampled
under two weight versions (as a fully async run would record them).
"""

from __future__ import annotations

from miles.rollout.session.chat import normalize_messages
from miles.rollout.session.picking import build_samples
from miles.rollout.session.recorder import Session, TurnRecord
from miles.utils.debug_data import load_rollout, save_rollout
from miles.utils.types import Sample, SampleStatus
from tests.session_helpers import CharTok


def _turn(s: Session, history: list[tuple[str, str]], text: str, version: str, lp: float) -> None:
    msgs = normalize_messages([{"role": r, "content": c} for r, c in history])
    prepared = s.prepare(msgs, None)
    out = [ord(c) for c in text + "$"]
    record = TurnRecord(prepared.input_ids, out, [lp / (i + 1) for i in range(len(out))], version, "stop")
    s.record(prepared, msgs, {"role": "assistant", "content": text}, record)


def _session_samples() -> list[Sample]:
    """What generate_with_agent hands the rollout for one episode: the picked leaves, session metadata on the
    first, the others marked as the session's extras."""
    s = Session("replay", CharTok())
    q = [("user", "q")]
    _turn(s, q, "x=1", "3", -0.1234567891234)
    _turn(s, [*q, ("assistant", "x=1"), ("tool", "1")], "ok", "4", -1e-300)
    _turn(s, [*q, ("assistant", "x=1 (short)"), ("user", "go")], "done", "4", -0.3)  # compaction: new lineage
    samples = build_samples(s, Sample(index=7, group_index=2, prompt="q", label="1", tokens=[ord("u")]))
    samples[0].metadata["session"] = {"leaves": 2, "lineages": s.lineages, "tree": s.tree()}
    for x in samples[1:]:
        x.metadata["session_extra"] = True
    for x in samples:
        x.reward, x.status = 1.0, SampleStatus.COMPLETED
    return samples


def test_session_samples_and_their_tree_round_trip_exactly(tmp_path) -> None:
    samples = _session_samples()
    assert len(samples) == 2 and samples[0].metadata["session"]["lineages"] == 2
    assert samples[1].weight_versions == ["3", "4"] and samples[0].weight_versions == ["4"]
    assert sum(samples[1].loss_mask) < len(samples[1].loss_mask)  # env tokens and exactly-once masking
    path = str(tmp_path / "dbg")
    save_rollout(path, 0, samples, {"rollout/raw_reward": 1.0}, "--save-debug-rollout-data")
    back, _ = load_rollout(path, 0, "--load-debug-rollout-data")
    assert back == samples  # tokens, masks, log-probs, weight versions, metadata (tree, leaf ids) exactly
    for a, b in zip(back, samples):
        assert a.rollout_log_probs == b.rollout_log_probs and a.check_consistent() is None
    assert [x.metadata["session_leaf"] for x in back] == [x.metadata["session_leaf"] for x in samples]
    tree = back[0].metadata["session"]["tree"]
    assert [n["weight_versions"] for n in tree] == [["3"], ["3", "4"], ["4"]]
    assert [(n["id"], n["parent"], n["leaf"], n["branch_of"]) for n in tree] == [
        (0, None, False, None),
        (1, 0, True, None),
        (2, None, True, 0),
    ]
    assert back[1].metadata["session_extra"] is True and "session_extra" not in back[0].metadata
