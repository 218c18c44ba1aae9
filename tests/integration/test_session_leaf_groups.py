"""Every picked leaf is trained (issue 26): a prompt group holds all the leaves of its sessions (variable group
size) through the session server, the default rollout and the runner; the leaves of a session share its reward.

The fake agent's session k (k = 1, 2, 3) asks k unrelated questions: k lineages, so k leaves.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from miles.algo.advantages import group_mean
from miles.config import parse_config
from miles.rollout.runner import RolloutRunner
from tests.fake_engine import FakeEngine, Reply
from tests.session_helpers import char_ids, qwen_style_tokenizer

AGENT = """
import httpx

async def leaves(base_url, sample, ctx):
    k = sample.index % 3 + 1  # the group's three sessions: 1, 2 and 3 lineages
    headers = {"Authorization": f"Bearer {ctx.api_key}"}
    async with httpx.AsyncClient() as http:
        for j in range(k):
            body = {"model": "m", "messages": [{"role": "user", "content": f"question {j}"}]}
            r = await http.post(f"{base_url}/chat/completions", json=body, headers=headers)
            r.raise_for_status()
    return k / 4
"""


@pytest.fixture
def agent_module(tmp_path, monkeypatch):
    (tmp_path / "fake_leaf_agent.py").write_text(textwrap.dedent(AGENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fake_leaf_agent"
    sys.modules.pop("fake_leaf_agent", None)


def test_a_group_holds_every_leaf_of_its_sessions(tmp_path, agent_module) -> None:
    tok = qwen_style_tokenizer()
    sampled: list[list[int]] = []

    def respond(ids: list[int], sp: dict, rid: str) -> Reply:
        out = char_ids(tok, f"answer {len(sampled)}") + [tok.eos_token_id]
        sampled.append(out)
        return Reply(out)

    engine = FakeEngine(respond)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "label": "1"}) + "\n")
    cfg = parse_config(
        f"--hf-checkpoint /m --prompt-data {data} --input-key prompt --label-key label --num-rollout 1 "
        "--rollout-batch-size 1 --n-samples-per-prompt 3 --global-batch-size 3 --colocate "
        f"--use-session-server --agent-function-path {agent_module}:leaves".split()
    )
    runner = RolloutRunner(
        cfg.data, cfg.rollout, cfg.eval, tok, engine.url, [engine.url], None, concurrency=8,
        transport=engine.transport,
    )  # fmt: skip
    try:
        samples, metrics = runner.generate(0)
    finally:
        runner.close()
    assert len(samples) == 6 and [s.index for s in samples] == list(range(6))
    assert {s.group_index for s in samples} == {0}
    # per session (in draw order): its own sample, then its other leaves; all share its reward
    assert [s.reward for s in samples] == [0.25, 0.5, 0.5, 0.75, 0.75, 0.75]
    assert [bool(s.metadata.get("session_extra")) for s in samples] == [False, False, True, False, True, True]
    assert [s.metadata["session"]["samples"] for s in samples if "session" in s.metadata] == [1, 2, 3]
    # every leaf is a trained sample: its prompt, then exactly the tokens the engine sampled, all trained once
    assert sorted(tuple(s.response_ids) for s in samples) == sorted(tuple(x) for x in sampled)
    for s in samples:
        assert s.loss_mask == [1] * s.response_length and s.check_consistent() is None
        assert tok.decode(s.tokens[: s.prompt_length]).count("question") == 1
    assert metrics["rollout/raw_reward"] == pytest.approx(sum(s.reward for s in samples) / 6)
    # GRPO's group baseline counts each leaf once: a session's reward weighs as many times as it has leaves
    baseline = group_mean(torch.tensor([s.reward for s in samples]), torch.zeros(6, dtype=torch.long))
    assert baseline[0].item() == pytest.approx((0.25 + 2 * 0.5 + 3 * 0.75) / 6)


def test_a_group_of_another_size_is_refused_without_sessions(tmp_path) -> None:
    engine = FakeEngine(lambda ids, sp, rid: Reply([5]))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "label": "1"}) + "\n")
    cfg = parse_config(
        f"--hf-checkpoint /m --prompt-data {data} --input-key prompt --label-key label --num-rollout 1 "
        "--rollout-batch-size 1 --n-samples-per-prompt 2 --global-batch-size 2 --colocate --rm-type math".split()
    )
    runner = RolloutRunner(
        cfg.data, cfg.rollout, cfg.eval, qwen_style_tokenizer(), engine.url, [engine.url], None, 8,
        transport=engine.transport,
    )  # fmt: skip
    from miles.rollout.base_types import RolloutOutput
    from miles.utils.types import Sample, SampleStatus

    done = Sample(tokens=[1, 2], response_length=1, loss_mask=[1], reward=1.0, status=SampleStatus.COMPLETED)
    with pytest.raises(ValueError, match="group 0 has 3 samples; --n-samples-per-prompt is 2$"):
        runner.finish_rollout(RolloutOutput(groups=[[done, done, done]]), 0)


def _train_body(rank: int, world: int, argv: list[str], samples_path: str, out: str) -> None:
    from miles.backends.fsdp_utils import rollout_batch as rb
    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.utils.seqlen_balancing import partition_samples_by_dp
    from miles.utils.types import Sample

    with open(samples_path) as f:
        samples = [Sample.from_dict(json.loads(line)) for line in f]
    parts = partition_samples_by_dp(
        [len(s.tokens) for s in samples], [s.group_index for s in samples], world, balance=False
    )
    mine = [samples[i] for i in parts[rank]]
    trainer = FSDPTrainer(parse_config(argv), rank, world)
    trainer.init("actor", with_ref=False)
    batch = rb.RankBatch.from_samples(mine, trainer.ps.device)
    steps = rb.plan_steps(batch, trainer.config, trainer.ps, trainer.steps_per_rollout)
    planned = sorted(i for step in steps for pack in step for i in pack.indices)
    metrics = trainer.train(0, mine)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"n": len(mine), "planned": planned, "mbs": [len(s) for s in steps], **metrics}, f)


def test_the_compacting_example_trains_every_leaf_for_a_step(tmp_path) -> None:
    """The compacting agent (examples/openai_agent) through the session server, the runner and a two-rank FSDP
    step: a session that called the tool has two leaves (the call, the compacted answer), one that answered
    at once has one; every leaf is trained, on DP ranks that got 3 and 4 samples."""
    from examples.openai_agent.build import build
    from miles.utils.seqlen_balancing import partition_samples_by_dp
    from tests.integration._util import run_distributed

    art = build(tmp_path / "art", n_train=8, n_eval=1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art / "model")
    call, eos = tok.convert_tokens_to_ids("<tool_call>"), tok.eos_token_id
    sampled: list[list[int]] = []

    def respond(ids: list[int], sp: dict, rid: str) -> Reply:
        first_session = rid.startswith("rollout0-0-")  # answers at once: one leaf
        asks = "calc says" not in tok.decode(ids) and not first_session
        out = ([call] if asks else tok.encode("42", add_special_tokens=False)) + [eos]
        sampled.append(out)
        return Reply(out)

    engine = FakeEngine(respond)
    argv = (
        f"--hf-checkpoint {art / 'model'} --prompt-data {art / 'train.jsonl'} --input-key prompt "
        "--label-key label --apply-chat-template --num-rollout 1 --rollout-batch-size 2 "
        "--n-samples-per-prompt 2 --global-batch-size 4 --micro-batch-size 1 --actor-num-gpus-per-node 2 "
        "--colocate --advantage-estimator grpo --lr 1e-3 --use-session-server "
        f"--agent-function-path examples.openai_agent.compacting:run --run-dir {tmp_path / 'run'}"
    ).split()
    cfg = parse_config(argv)
    runner = RolloutRunner(
        cfg.data, cfg.rollout, cfg.eval, tok, engine.url, [engine.url], None, concurrency=8,
        transport=engine.transport,
    )  # fmt: skip
    try:
        samples, _ = runner.generate(0)
    finally:
        runner.close()
    # 1 + 2 leaves in group 0, 2 + 2 in group 1: 7 samples, every sampled token trained exactly once
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1, 1]
    assert sorted(tuple(s.response_ids) for s in samples) == sorted(tuple(x) for x in sampled)
    for s in samples:
        assert s.loss_mask == [1] * s.response_length and s.check_consistent() is None
    extra = [bool(s.metadata.get("session_extra")) for s in samples]
    assert extra == [False, False, True, False, True, False, True]
    # a session's leaves share its reward: 0 answering "42" without the tool, 0.7 (or 1.0) with it
    rewards = [s.reward for s in samples]
    assert (
        rewards[0] == 0.0
        and rewards[1] == rewards[2]
        and rewards[3] == rewards[4] == rewards[5] == rewards[6]
    )
    assert rewards[1] >= 0.7
    parts = partition_samples_by_dp(
        [len(s.tokens) for s in samples], [s.group_index for s in samples], 2, False
    )
    assert sorted(len(p) for p in parts) == [3, 4]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))
    run_distributed(_train_body, 2, argv, str(path), str(tmp_path / "m"), init_pg=False)
    ranks = [json.loads((tmp_path / f"m.{r}").read_text()) for r in range(2)]
    # one optimizer step (steps_per_rollout = 4 / 4) over what each rank got; both ran 3 micro-batches
    assert [r["planned"] for r in ranks] == [list(range(r["n"])) for r in ranks]
    assert [r["mbs"] for r in ranks] == [[3], [3]]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in ranks)
