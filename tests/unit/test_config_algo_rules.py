"""Cross-field rules between the algorithm flags and the data-parallel layout."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_config

BASE = [
    "--hf-checkpoint",
    "/m",
    "--prompt-data",
    "/d.jsonl",
    "--num-rollout",
    "2",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--global-batch-size",
    "8",
    "--actor-num-gpus-per-node",
    "2",
    "--colocate",
]


def _violations(extra: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + extra)
    return str(e.value)


def test_kl_reward_penalty_needs_a_reinforce_estimator():
    assert "--kl-coef" in _violations(["--kl-coef", "0.1"])
    cfg = parse_config(BASE + ["--kl-coef", "0.1", "--advantage-estimator", "reinforce_plus_plus"])
    assert cfg.algo.kl_coef == 0.1
    parse_config(BASE + ["--kl-coef", "0.0"])  # the reference script passes 0 with grpo


def test_rollout_logprobs_and_tis_are_exclusive():
    assert "--use-rollout-logprobs" in _violations(["--use-rollout-logprobs", "--use-tis"])
    parse_config(BASE + ["--use-rollout-logprobs"])
    parse_config(BASE + ["--use-tis"])


def test_prompt_groups_must_split_evenly_over_dp():
    message = _violations(["--rollout-batch-size", "3", "--global-batch-size", "6"])
    assert "--rollout-batch-size=3" in message and "data-parallel size 2" in message
    # cp=2 on 2 workers leaves dp=1: any batch size works
    parse_config(
        BASE + ["--rollout-batch-size", "3", "--global-batch-size", "6", "--context-parallel-size", "2"]
    )


def test_secrets_are_redacted_for_trackers_but_round_trip_otherwise():
    cfg = parse_config(BASE + ["--use-wandb", "--wandb-project", "p", "--wandb-key", "SECRET"])
    assert cfg.to_dict(redact_secrets=True)["log"]["wandb_key"] == "<redacted>"
    assert "SECRET" not in cfg.to_yaml()
    assert type(cfg).from_dict(cfg.to_dict()).log.wandb_key == "SECRET"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([], "ppo"),
        (["--advantage-estimator", "gspo"], "gspo"),  # the estimator's default
        (["--policy-loss", "gspo"], "gspo"),  # GSPO's sequence ratio with GRPO advantages
        (["--advantage-estimator", "gspo", "--policy-loss", "ppo"], "ppo"),
    ],
)
def test_policy_loss_flag_and_its_default_from_the_estimator(extra, expected):
    from miles.backends.fsdp_utils.rollout_batch import trainer_algo

    assert trainer_algo(parse_config(BASE + extra)).loss.policy.name == expected


def test_unknown_policy_loss_names_the_flag_and_the_choices():
    message = _violations(["--policy-loss", "grpo"])
    assert "--policy-loss" in message and "gspo" in message and "ppo" in message


def test_critic_flags_belong_to_ppo():
    assert "--critic-lr" in _violations(["--critic-lr", "1e-5"])
    assert "--num-critic-only-steps" in _violations(["--num-critic-only-steps", "1"])
    cfg = parse_config(BASE + ["--advantage-estimator", "ppo", "--critic-lr", "1e-5", "--lambd", "0.95",
                               "--num-critic-only-steps", "1", "--value-clip", "0.5"])  # fmt: skip
    assert (cfg.critic.critic_lr, cfg.algo.lambd, cfg.critic.value_clip) == (1e-5, 0.95, 0.5)
    # every rollout critic-only: the actor would never train
    assert "--num-critic-only-steps" in _violations(
        ["--advantage-estimator", "ppo", "--num-critic-only-steps", "2"]
    )
    assert "--lambd" in _violations(["--advantage-estimator", "ppo", "--lambd", "1.5"])


def test_lora_reference_is_the_base():
    cfg = parse_config(BASE + ["--lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"])
    assert cfg.lora.lora_rank == 8 and list(cfg.lora.lora_target_modules) == ["q_proj", "v_proj"]
    assert "--ref-load" in _violations(["--lora-rank", "8", "--ref-load", "/r"])
    assert "--ref-update-interval" in _violations(["--lora-rank", "8", "--ref-update-interval", "2"])
    assert "--lora-dropout" in _violations(["--lora-rank", "8", "--lora-dropout", "1.0"])
    parse_config(BASE + ["--ref-load", "/r"])  # without LoRA a separate reference is fine


def test_lora_refit_ships_the_adapter_unless_engines_are_external():
    cfg = parse_config(BASE + ["--lora-rank", "8"])
    assert (
        cfg.lora.lora_refit == "adapter"
    )  # auto: miles launches the engines, so it gives SGLang its LoRA flags
    args = cfg.engine.sglang_args
    assert (args["enable_lora"], args["max_lora_rank"], args["lora_target_modules"]) == (True, "8", "all")
    merged = parse_config(BASE + ["--lora-rank", "8", "--lora-refit", "merged"])
    assert merged.lora.lora_refit == "merged" and "enable_lora" not in merged.engine.sglang_args
    external = ["--rollout-external-engine-addrs", "127.0.0.1:30000", "--lora-rank", "8"]
    base = [a for a in BASE if a != "--colocate"]  # external engines are never colocated
    cfg = parse_config(base + external)
    assert cfg.lora.lora_refit == "merged" and "enable_lora" not in cfg.engine.sglang_args
    assert parse_config(base + external + ["--lora-refit", "adapter"]).lora.lora_refit == "adapter"
    assert "enable_lora" not in parse_config(BASE).engine.sglang_args  # no LoRA: nothing added
    with pytest.raises(ConfigError, match="--lora-refit"):
        parse_config(BASE + ["--lora-rank", "8", "--lora-refit", "both"])


def test_trainer_algo_builds_the_records_and_resolves_custom_functions_once(tmp_path, monkeypatch):
    from miles.algo import MIS, OPSM, TIS, CustomMismatch, KLPenalty, LossReduction, TISAndMIS, compute_loss
    from miles.backends.fsdp_utils.rollout_batch import trainer_algo

    algo = trainer_algo(parse_config(BASE))
    assert algo.loss.kl is None and algo.loss.mismatch is None and algo.loss.policy.opsm is None
    assert algo.loss_fn is compute_loss and algo.advantage_fn is None
    flags = ["--use-tis", "--tis-clip", "1.5", "--use-mis", "--mis-level", "sequence", "--use-opsm"]
    flags += ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--calculate-per-token-loss"]
    loss = trainer_algo(parse_config(BASE + flags)).loss
    assert loss.mismatch == TISAndMIS(TIS(lo=0.0, hi=1.5), MIS(level="sequence", lo=0.5, hi=2.0))
    assert loss.policy.opsm == OPSM(delta=1e-4)
    assert loss.kl == KLPenalty(coef=0.1, type="k3", unbiased=False)
    # --calculate-per-token-loss and the constant's fallback were derived by the config, not again here
    assert loss.reduction == LossReduction(kind="token_mean", constant=1024.0)

    (tmp_path / "algo_plugins_mod.py").write_text(
        "def weights(old, rollout, masks, settings):\n    return masks, {}\n\n"
        "def loss(inputs, settings):\n    raise AssertionError\n\n"
        "def advantages(inputs):\n    raise AssertionError\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import algo_plugins_mod

    custom = [
        "--custom-tis-function-path",
        "algo_plugins_mod:weights",
        "--custom-loss-function-path",
        "algo_plugins_mod:loss",
        "--custom-advantage-function-path",
        "algo_plugins_mod:advantages",
    ]
    algo = trainer_algo(parse_config(BASE + custom))
    assert algo.loss.mismatch == CustomMismatch(algo_plugins_mod.weights)
    assert algo.loss_fn is algo_plugins_mod.loss
    assert algo.advantage_fn is not None
    cfg = parse_config(BASE + ["--custom-loss-function-path", "algo_plugins_mod:absent"])
    with pytest.raises(ValueError, match="--custom-loss-function-path='algo_plugins_mod:absent'"):
        trainer_algo(cfg)
