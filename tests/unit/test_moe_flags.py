"""MoE flags: defaults keep today's numbers; with context parallelism they validate (issue 28: the replayed experts
and the router losses' statistics follow the CP split, tests/integration/test_moe_context_parallel.py)."""

from __future__ import annotations

import pytest

from miles.config import parse_config

BASE = [
    "--hf-checkpoint",
    "m",
    "--prompt-data",
    "p.jsonl",
    "--rollout-batch-size",
    "4",
    "--global-batch-size",
    "4",
    "--num-rollout",
    "1",
    "--colocate",
]


def test_defaults_are_off():
    cfg = parse_config(BASE)
    assert cfg.train.moe_aux_loss_coeff == 0.0 and cfg.train.moe_z_loss_coeff == 0.0
    assert not cfg.rollout.use_rollout_routing_replay and not cfg.train.use_routing_replay


@pytest.mark.parametrize(
    "flag", [["--use-rollout-routing-replay"], ["--use-routing-replay"], ["--moe-aux-loss-coeff", "0.01"]]
)
def test_accepted_with_context_parallelism(flag):
    cp = ["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"]
    cfg = parse_config(BASE + cp + flag)
    assert cfg.train.context_parallel_size == 2
