"""Property tests for miles.config: batch/parallel rules against a plain reference, value round trips."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.config import Config, ConfigError, parse_config

REQUIRED = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "3", "--colocate"]


def _reference_ok(rbs: int, n: int, gbs: int, world: int, cp: int, mbs: int, dynamic: bool) -> bool:
    """The batch rules written out plainly."""
    if (rbs * n) % gbs != 0:
        return False
    if world % cp != 0:
        return False
    dp = world // cp
    if rbs % dp != 0:  # prompt groups stay whole on one DP rank
        return False
    if dynamic:
        return True
    if gbs % dp != 0:
        return False
    per_rank = gbs // dp
    return per_rank % mbs == 0


@settings(max_examples=150, deadline=None)
@given(
    rbs=st.integers(1, 16),
    n=st.integers(1, 8),
    gbs=st.integers(1, 64),
    nodes=st.integers(1, 2),
    gpus=st.integers(1, 8),
    cp=st.integers(1, 4),
    mbs=st.integers(1, 4),
    dynamic=st.booleans(),
)
def test_batch_rules_match_reference(
    rbs: int, n: int, gbs: int, nodes: int, gpus: int, cp: int, mbs: int, dynamic: bool
) -> None:
    argv = REQUIRED + [
        "--rollout-batch-size", str(rbs), "--n-samples-per-prompt", str(n), "--global-batch-size", str(gbs),
        "--actor-num-nodes", str(nodes), "--actor-num-gpus-per-node", str(gpus),
        "--context-parallel-size", str(cp), "--micro-batch-size", str(mbs), "--max-tokens-per-gpu", "512",
        "--use-dynamic-batch-size" if dynamic else "--no-use-dynamic-batch-size",
        "--engine-host", "0.0.0.0", "--engine-api-key", "k",  # reachable from other nodes when nodes > 1
    ]  # fmt: skip
    expected = _reference_ok(rbs, n, gbs, nodes * gpus, cp, mbs, dynamic)
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        assert not expected, e.violations
        flags = (
            "--global-batch-size",
            "--context-parallel-size",
            "--micro-batch-size",
            "--rollout-batch-size",
        )
        assert all(v.startswith(flags) for v in e.violations), e.violations
        return
    assert expected
    assert cfg.optim.lr_decay_iters == 3 * (rbs * n // gbs)


finite = st.floats(min_value=0.0, max_value=1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=40, deadline=None)
@given(lr=finite, buffer=st.integers(1, 2**62), stop=st.lists(st.text(min_size=1, max_size=5), max_size=3))
def test_values_survive_cli_yaml_and_dict_round_trips(lr: float, buffer: int, stop: list[str]) -> None:
    argv = REQUIRED + ["--rollout-batch-size", "2", "--global-batch-size", "2", "--lr", repr(lr)]
    argv += ["--update-weight-buffer-size", str(buffer)]
    cfg = parse_config(argv)
    d = cfg.to_dict()
    d["rollout"]["rollout_stop"] = stop or None
    cfg = Config.from_dict(d)
    assert cfg.optim.lr == lr and cfg.train.update_weight_buffer_size == buffer
    assert cfg.rollout.rollout_stop == (stop or None)
    again = Config.from_dict(yaml.safe_load(cfg.to_yaml(redact_secrets=False)))
    assert again == cfg and math.copysign(1.0, again.optim.lr) == 1.0


def test_yaml_scalar_quirks(tmp_path: Path) -> None:
    """PyYAML reads `1e-6` as a string and `off` as a boolean; both are handled explicitly."""
    path = tmp_path / "quirks.yaml"
    path.write_text("lr: 1e-6\nrollout-batch-size: 2\nglobal-batch-size: 2.0\nwandb-mode: off\n")
    try:
        parse_config(REQUIRED + ["--config", str(path)])
    except ConfigError as e:
        assert e.violations == [
            f"--wandb-mode=False [{path}]: expected a string, got bool (quote it in YAML)"
        ]
    else:
        raise AssertionError("an unquoted YAML `off` must not pass as a wandb mode")
    path.write_text("lr: 1e-6\nrollout-batch-size: 2\nglobal-batch-size: 2.0\nwandb-mode: 'offline'\n")
    cfg = parse_config(REQUIRED + ["--config", str(path)])
    assert cfg.optim.lr == 1e-6 and cfg.train.global_batch_size == 2 and cfg.log.wandb_mode == "offline"


def test_check_weight_update_equal_is_on_by_default_for_any_engine_tp() -> None:
    """Checksums are compared per TP rank's shard, so engines of several GPUs take them too (on by default);
    --no-check-weight-update-equal turns them off."""
    from miles.config import parse_config

    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2",
            "--global-batch-size", "2", "--actor-num-gpus-per-node", "2", "--colocate"]  # fmt: skip
    assert parse_config(base).engine.check_weight_update_equal
    assert parse_config([*base, "--rollout-num-gpus-per-engine", "2"]).engine.check_weight_update_equal
    assert not parse_config([*base, "--no-check-weight-update-equal"]).engine.check_weight_update_equal


def test_refit_deadline_must_expire_before_the_drivers_wait() -> None:
    base = REQUIRED + ["--rollout-batch-size", "1", "--global-batch-size", "1"]
    assert parse_config(base).train.refit_timeout < parse_config(base).train.train_timeout
    try:
        parse_config(base + ["--refit-timeout", "100", "--train-timeout", "100"])
    except ConfigError as e:
        assert "--refit-timeout" in str(e) and "below --train-timeout (100)" in str(e), str(e)
    else:
        raise AssertionError("--refit-timeout >= --train-timeout was accepted")


@pytest.mark.parametrize(("train", "refit"), [(None, 300.0), ("3600", 300.0), ("300", 150.0), ("60", 30.0)])
def test_refit_timeout_defaults_below_train_timeout(train, refit) -> None:
    """Unset, --refit-timeout follows --train-timeout down (a short --train-timeout alone is accepted)."""
    base = REQUIRED + ["--rollout-batch-size", "1", "--global-batch-size", "1"]
    cfg = parse_config(base + (["--train-timeout", train] if train else []))
    assert cfg.train.refit_timeout == refit
    # An explicit value is kept, and an explicit inconsistent pair is still refused.
    assert (
        parse_config(base + ["--train-timeout", "300", "--refit-timeout", "200"]).train.refit_timeout == 200
    )
    with pytest.raises(ConfigError, match="--refit-timeout=400.0: must be below --train-timeout"):
        parse_config(base + ["--train-timeout", "300", "--refit-timeout", "400"])


def test_update_weight_transfer_mode_rules() -> None:
    """broadcast cannot serve colocated engines; tensor handles cannot leave a node (refused before Ray starts)."""
    import pytest

    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2",
            "--global-batch-size", "2"]  # fmt: skip
    assert parse_config([*base, "--colocate"]).train.update_weight_transfer_mode == "auto"
    disagg = [*base, "--rollout-num-gpus", "1", "--engine-host", "0.0.0.0", "--engine-api-key", "k"]
    assert parse_config(
        [*disagg, "--update-weight-transfer-mode", "broadcast"]
    ).train.update_weight_transfer_mode == ("broadcast")
    assert parse_config([*base, "--colocate", "--update-weight-transfer-mode", "tensor"])
    with pytest.raises(ConfigError, match="update-weight-transfer-mode.*--colocate"):
        parse_config([*base, "--colocate", "--update-weight-transfer-mode", "broadcast"])
    with pytest.raises(ConfigError, match="update-weight-transfer-mode.*--actor-num-nodes=2"):
        parse_config([*disagg, "--actor-num-nodes", "2", "--update-weight-transfer-mode", "tensor"])
    assert parse_config([*disagg, "--actor-num-nodes", "2", "--update-weight-transfer-mode", "broadcast"])
    with pytest.raises(ConfigError, match="update-weight-transfer-mode"):
        parse_config([*base, "--colocate", "--update-weight-transfer-mode", "nccl"])
    two_engines = [*base, "--rollout-num-gpus", "2"]  # 1 trainer + 2 engines disaggregated
    with pytest.raises(ConfigError, match="update-weight-transfer-mode.*2 engines 1 training rank"):
        parse_config([*two_engines, "--update-weight-transfer-mode", "tensor"])
    assert parse_config(
        [*two_engines, "--actor-num-gpus-per-node", "2", "--update-weight-transfer-mode", "tensor"]
    )
    assert parse_config(two_engines).train.update_weight_transfer_mode == "auto"


def test_auto_transfer_mode_broadcasts_when_engines_outnumber_trainer_ranks() -> None:
    """auto on CPU: tensor handles while every engine has training ranks of its own, else broadcast (the
    1 trainer + 2 engines placement raised in the tensor-handle transport)."""
    from miles.refit.refitter import resolve_transfer_mode as resolve

    assert (
        resolve("auto", colocate=False, is_cuda=False, n_engines=1, ranks_per_engine=1, world_size=1)
        == "tensor"
    )
    assert resolve("auto", False, False, n_engines=2, ranks_per_engine=1, world_size=1) == "broadcast"
    assert resolve("auto", False, False, n_engines=2, ranks_per_engine=1, world_size=2) == "tensor"
    assert resolve("auto", False, False, n_engines=1, ranks_per_engine=2, world_size=1) == "broadcast"
    assert resolve("auto", True, False, n_engines=2, ranks_per_engine=1, world_size=1) == "tensor"
    assert resolve("auto", False, True, n_engines=1, ranks_per_engine=1, world_size=1) == "broadcast"
    assert resolve("tensor", False, False, n_engines=2, ranks_per_engine=1, world_size=1) == "tensor"
