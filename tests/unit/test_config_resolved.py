"""A validated Config holds resolved values: no None in a field declared `resolved`, steps per rollout derived
once, and the object itself crosses to the Ray actors (pickled, secrets included)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from miles.config import FIELDS, Config, parse_config

BASE = (
    "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 3 --rollout-batch-size 4 --n-samples-per-prompt 4 "
    "--global-batch-size 8 --rollout-num-gpus 1"
).split()


def test_steps_per_rollout_is_derived_once_at_validation() -> None:
    cfg = parse_config(BASE)
    assert cfg.train.steps_per_rollout == 4 * 4 // 8 == 2
    assert cfg.optim.lr_decay_iters == 3 * 2  # derived from it
    assert parse_config(BASE + ["--global-batch-size", "16"]).train.steps_per_rollout == 1
    assert "steps_per_rollout" not in cfg.to_dict()["train"]  # no flag: from_dict derives it again
    assert "steps_per_rollout" not in FIELDS
    assert Config.from_dict(cfg.to_dict()).train.steps_per_rollout == 2


def test_no_resolved_field_is_none_after_validation() -> None:
    cfg = parse_config(BASE + ["--advantage-estimator", "gspo", "--lr", "0.01", "--rollout-top-p", "0.9"])
    resolved = [name for name, spec in FIELDS.items() if spec.meta("resolved") and name != "eval_label_key"]
    assert len(resolved) >= 17
    for name in resolved:
        section = getattr(cfg, FIELDS[name].section or "")
        assert getattr(section, name) is not None, name
    assert cfg.algo.policy_loss == "gspo" and cfg.critic.critic_lr == 0.01 and cfg.eval.eval_top_p == 0.9
    assert cfg.rollout.over_sampling_batch_size == 4 and cfg.eval.eval_input_key == cfg.data.input_key


def test_the_flag_surface_keeps_null_as_the_user_visible_default() -> None:
    for name in ("over_sampling_batch_size", "eval_temperature", "critic_lr", "policy_loss", "refit_timeout"):
        assert FIELDS[name].default is None and FIELDS[name].optional


def test_critic_lr_equal_to_lr_reads_back_without_ppo() -> None:
    cfg = parse_config(BASE)
    assert Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="--critic-lr=0.5.*only applies to --advantage-estimator ppo"):
        parse_config(BASE + ["--critic-lr", "0.5"])


def test_the_config_object_pickles_with_its_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ENGINE_API_KEY", "engine-secret")
    cfg = parse_config(BASE + ["--wandb-key", "wandb-secret"])
    again = pickle.loads(pickle.dumps(cfg))
    assert (
        again == cfg
        and again.engine.engine_api_key == "engine-secret"
        and again.log.wandb_key == "wandb-secret"
    )
    assert again.train.steps_per_rollout == 2
    redacted = cfg.to_dict(redact_secrets=True)  # what goes to trackers and files
    assert redacted["engine"]["engine_api_key"] == redacted["log"]["wandb_key"] == "<redacted>"
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.train.global_batch_size = 1  # type: ignore[misc]
