"""The FSDP critic (--advantage-estimator ppo) without Ray: DP=2 equals DP=1, CP=2 equals CP=1, the actor trains on
the critic's values, and the critic's checkpoint resumes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.integration._util import run_distributed, save_tiny_qwen3
from tests.integration.test_fsdp_trainer import VOCAB, _config, _multi_turn_rollout, _rollout

PPO = ["--advantage-estimator", "ppo", "--gamma", "0.95", "--lambd", "0.9", "--critic-lr", "0.05"]


def _critic_body(rank: int, world: int, model_dir: str, out: str, extra: list[str], multi_turn: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.backends.fsdp_utils.critic import FSDPCritic
    from miles.utils.seqlen_balancing import partition_samples_by_dp

    samples = _multi_turn_rollout(model_dir) if multi_turn else _rollout(model_dir)
    cfg = _config(model_dir, world, PPO + extra)
    cp = cfg.train.context_parallel_size
    parts = partition_samples_by_dp(
        [len(s.tokens) for s in samples], [s.group_index for s in samples], world // cp, balance=False
    )
    mine = [samples[i] for i in parts[rank // cp]]
    critic = FSDPCritic(cfg, rank, world)
    assert critic.init("critic", with_ref=False) == 0
    first = critic.train(0, mine)
    second = critic.train(1, mine)  # the values moved: the second call's old values are the updated critic's
    critic.sleep()
    actor = FSDPTrainer(cfg, rank, world)
    assert actor.init("actor", with_ref=False) == 0
    actor_metrics = actor.train(0, mine, first["values"])
    state = get_model_state_dict(
        critic.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    values = [None] * len(samples)
    for i, v in zip(parts[rank // cp], first["values"]):
        values[i] = v
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, values)
    if rank == 0:
        merged = [next(g[i] for g in gathered if g[i] is not None) for i in range(len(samples))]
        torch.save({k: v.clone() for k, v in state.items()}, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump(
                {"first": first["metrics"], "second": second["metrics"], "actor": actor_metrics,
                 "values": merged, "values2": second["values"]}, f)  # fmt: skip


def _run(tmp_path, world: int, extra: list[str], name: str, multi_turn: bool = False):
    model_dir = str(tmp_path / "model")
    if not os.path.exists(model_dir):
        save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / name)
    run_distributed(_critic_body, world, model_dir, out, extra, multi_turn, init_pg=False)
    with open(out + ".json") as f:
        return torch.load(out + ".pt"), json.load(f)


def _compare(a, b):
    (w1, m1), (w2, m2) = a, b
    for key in (
        "critic/value_loss",
        "critic/value_clipfrac",
        "critic/grad_norm",
        "critic/explained_variance",
    ):
        assert key in m1["first"], key
        assert m1["first"][key] == pytest.approx(m2["first"][key], abs=1e-5), key
        assert m1["second"][key] == pytest.approx(m2["second"][key], abs=1e-5), key
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/advantage_std"):
        assert m1["actor"][key] == pytest.approx(m2["actor"][key], abs=1e-5), key


def test_critic_dp2_equals_dp1_and_learns(tmp_path):
    # SGD: Adam turns fp32 summation-order noise in near-zero gradients into visible steps (see test_fsdp_trainer)
    extra = ["--optimizer", "sgd", "--lr", "0.5", "--critic-lr", "0.5"]
    one = _run(tmp_path, 1, extra, "dp1")
    two = _run(tmp_path, 2, extra, "dp2")
    _compare(one, two)
    m = one[1]
    # a fresh value head predicts 0 everywhere; after one step the values move toward the returns
    assert all(v == 0.0 for vals in m["values"] for v in vals)
    assert any(v != 0.0 for vals in m["values2"] for v in vals)
    assert m["second"]["critic/value_loss"] < m["first"]["critic/value_loss"]
    assert m["actor"]["train/first_mb_ppo_kl_abs_max"] == 0.0
    assert m["actor"]["train/advantage_std"] > 0.0


def test_critic_cp2_equals_cp1_multi_turn(tmp_path):
    extra = ["--micro-batch-size", "2", "--optimizer", "sgd", "--lr", "0.5", "--critic-lr", "0.5"]
    one = _run(tmp_path, 1, extra, "cp1", multi_turn=True)
    two = _run(tmp_path, 2, extra + ["--context-parallel-size", "2"], "cp2", multi_turn=True)
    _compare(one, two)


def _resume_body(rank: int, world: int, model_dir: str, save_dir: str, out: str) -> None:
    from miles.backends.fsdp_utils.critic import FSDPCritic

    samples = _rollout(model_dir)
    straight = FSDPCritic(_config(model_dir, world, PPO + ["--save", save_dir]), rank, world)
    straight.init("critic", with_ref=False)
    straight.train(0, samples)
    straight.save(0)
    want = straight.train(1, samples)
    resumed = FSDPCritic(_config(model_dir, world, PPO + ["--load", save_dir]), rank, world)
    assert resumed.init("critic", with_ref=False) == 1
    got = resumed.train(1, samples)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"want": want, "got": got}, f)


def test_critic_checkpoint_resumes_bit_exact(tmp_path):
    model_dir = str(tmp_path / "model")
    save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / "resume.json")
    run_distributed(_resume_body, 1, model_dir, str(tmp_path / "ckpt"), out, init_pg=False)
    with open(out) as f:
        r = json.load(f)
    assert os.path.isdir(tmp_path / "ckpt" / "critic" / "iter_0000000")
    assert r["got"]["values"] == r["want"]["values"]
    for key in ("critic/value_loss", "critic/grad_norm"):
        assert r["got"]["metrics"][key] == r["want"]["metrics"][key]
