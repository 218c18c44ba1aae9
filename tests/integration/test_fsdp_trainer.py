"""The FSDP trainer end to end without Ray: init -> train on a synthetic rollout, 1 and 2 gloo processes."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from miles.utils.types import Sample, SampleStatus
from tests.integration._util import run_distributed, save_tiny_qwen3

VOCAB = 96


def _rollout(model_dir: str, n_groups: int = 4, n_per_group: int = 2, seed: int = 0) -> list[Sample]:
    """Samples with random tokens, rewards varying within each group, and rollout log-probs of the same model."""
    from transformers import AutoModelForCausalLM

    from miles.algo.logprobs import compute_log_probs

    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        for k in range(n_per_group):
            response = [rng.randrange(0, VOCAB) for _ in range(rng.randint(1, 7))]
            tokens = prompt + response
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0]
            lp = compute_log_probs(logits[len(prompt) - 1 : -1], torch.tensor(response), 0.8)
            samples.append(
                Sample(
                    index=len(samples),
                    group_index=g,
                    tokens=tokens,
                    response_length=len(response),
                    loss_mask=[1] * len(response),
                    rollout_log_probs=lp.tolist(),
                    reward=float(rng.random() < 0.5) + 0.1 * k,
                    status=SampleStatus.COMPLETED,
                )
            )
    return samples


def _multi_turn_rollout(
    model_dir: str, n_groups: int = 4, n_per_group: int = 2, seed: int = 1
) -> list[Sample]:
    """Samples shaped like tool use: model turn, tool answer (loss mask 0, log-prob 0.0), model turn. The model
    tokens carry the model's own log-probs; the tool tokens carry none."""
    from transformers import AutoModelForCausalLM

    from miles.algo.logprobs import compute_log_probs

    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))]
        for k in range(n_per_group):
            segments = [rng.randint(1, 4), rng.randint(2, 5), rng.randint(1, 4)]  # model, tool, model
            response = [rng.randrange(0, VOCAB) for _ in range(sum(segments))]
            mask = [1] * segments[0] + [0] * segments[1] + [1] * segments[2]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + response])).logits[0]
            lp = compute_log_probs(logits[len(prompt) - 1 : -1], torch.tensor(response), 0.8).tolist()
            sample = Sample(index=len(samples), group_index=g, tokens=list(prompt), status=SampleStatus.COMPLETED,
                            reward=float(rng.random() < 0.5) + 0.1 * k)  # fmt: skip
            sample.append_tokens(response[: segments[0]], lp[: segments[0]], trainable=True)
            sample.append_tokens(response[segments[0] : -segments[2]], None, trainable=False)
            sample.append_tokens(response[-segments[2] :], lp[-segments[2] :], trainable=True)
            assert sample.loss_mask == mask and sample.rollout_log_probs[segments[0]] == 0.0
            samples.append(sample)
    return samples


def _multi_turn_body(rank: int, world: int, model_dir: str, out: str) -> None:
    from miles.backends.fsdp_utils.actor import FSDPTrainer

    trainer = FSDPTrainer(_config(model_dir, world, ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "40"]),
                          rank, world)  # fmt: skip
    trainer.init("actor", with_ref=False)
    metrics = trainer.train(0, _multi_turn_rollout(model_dir))
    with open(out, "w") as f:
        json.dump(metrics, f)


def test_multi_turn_samples_train_only_on_model_tokens(tmp_path):
    """Tool tokens (mask 0, no log-probs) ride along in the packed rows: the packed log-probs of the model tokens
    still equal the rollout's (the masked comparison ignores the tool tokens' 0.0) and step 1 is on-policy."""
    model_dir = str(tmp_path / "model")
    save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / "mt.json")
    run_distributed(_multi_turn_body, 1, model_dir, out, init_pg=False)
    with open(out) as f:
        m = json.load(f)
    assert m["train/first_mb_ppo_kl_abs_max"] == 0.0
    assert m["train/train_rollout_logprob_abs_diff"] <= 1e-5


def _config(model_dir: str, world: int, extra: list[str]):
    from miles.config import parse_config

    return parse_config(
        [
            "--hf-checkpoint",
            model_dir,
            "--prompt-data",
            "unused.jsonl",
            "--num-rollout",
            "3",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "8",
            "--actor-num-gpus-per-node",
            str(world),
            "--colocate",
            "--rollout-temperature",
            "0.8",
            "--lr",
            "1e-2",
            "--optimizer",
            "adam",
            "--seed",
            "7",
            "--run-dir",
            os.path.dirname(model_dir),
        ]
        + extra
    )


def _train_body(rank: int, world: int, model_dir: str, out: str, extra: list[str], rollouts: int = 1) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.utils.seqlen_balancing import partition_samples_by_dp

    samples = _rollout(model_dir)
    cp = int(extra[extra.index("--context-parallel-size") + 1]) if "--context-parallel-size" in extra else 1
    parts = partition_samples_by_dp(
        [len(s.tokens) for s in samples], [s.group_index for s in samples], world // cp, balance=False
    )
    cfg = _config(model_dir, world, extra)
    dp_rank = rank // cfg.train.context_parallel_size
    trainer = FSDPTrainer(cfg, rank, world)
    assert trainer.init("actor", with_ref="--use-kl-loss" in extra) == 0
    for rollout_id in range(rollouts):
        metrics = trainer.train(rollout_id, [samples[i] for i in parts[dp_rank]])
    state = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({k: v.clone() for k, v in state.items()}, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump(metrics, f)


def _run(tmp_path, world: int, extra: list[str], name: str, rollouts: int = 1) -> tuple[dict, dict]:
    model_dir = str(tmp_path / "model")
    if not os.path.exists(model_dir):
        save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / name)
    run_distributed(_train_body, world, model_dir, out, extra, rollouts, init_pg=False)
    with open(out + ".json") as f:
        return torch.load(out + ".pt"), json.load(f)


# Adam turns fp32 rounding noise in near-zero gradients into visible steps (its step lr * g / (|g| + eps) is
# steepest at |g| ~ eps): the gradient reduction sums in another order under DP=2, and with eps = 1e-8 one
# weight of 2048 once moved 3e-5 apart. A larger eps bounds that sensitivity by lr / eps while still exercising
# the sharded Adam state. Summation order also differs whenever packs differ (dynamic batching): compared under SGD.
@pytest.mark.parametrize(
    "extra",
    [
        ["--adam-eps", "1e-4"],
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--optimizer", "sgd", "--lr", "0.5"],
        ["--adam-eps", "1e-4", "--loss-reduction", "token_mean"],
    ],
    ids=["static-adam", "dynamic-sgd", "token-mean"],
)
def test_dp2_update_equals_dp1(tmp_path, extra):
    w1, m1 = _run(tmp_path, 1, extra, "dp1")
    w2, m2 = _run(tmp_path, 2, extra, "dp2")
    # first micro-batch: old and new log-probs come from the same weights
    assert m1["train/first_mb_ppo_kl_abs_max"] == 0.0
    assert m2["train/first_mb_ppo_kl_abs_max"] == 0.0
    assert m1["train/ppo_kl"] == 0.0  # one optimizer step per rollout: every micro-batch is on-policy
    for key in (
        "train/loss",
        "train/pg_loss",
        "train/pg_clipfrac",
        "train/grad_norm",
        "train/train_rollout_logprob_abs_diff",
    ):
        assert key in m1, key
        assert m1[key] == pytest.approx(m2[key], abs=1e-5), key
    assert m1["train/train_rollout_logprob_abs_diff"] < 1e-5
    changed = False
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).state_dict()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)
        changed |= not torch.equal(w1[k], base[k])
    assert changed, "the optimizer step did not change any weight"


@pytest.mark.parametrize("cp", [1, 2])
def test_samples_over_the_token_cap_train_alone_with_the_same_update(tmp_path, cp):
    """--max-tokens-per-gpu below the longest samples (2..13 tokens here): each such sample is a micro-batch of
    its own (the reference's behaviour) instead of an error mid-run, and the update equals the one where every
    sample fits (under SGD, as packs change the summation order)."""
    sgd = ["--use-dynamic-batch-size", "--optimizer", "sgd", "--lr", "0.5"]
    cp_args = ["--context-parallel-size", str(cp)] if cp > 1 else []
    w_fit, m_fit = _run(tmp_path, cp, [*sgd, "--max-tokens-per-gpu", "64", *cp_args], "fit")
    w_long, m_long = _run(tmp_path, cp, [*sgd, "--max-tokens-per-gpu", str(8 // cp), *cp_args], "long")
    assert max(len(s.tokens) for s in _rollout(str(tmp_path / "model"))) > 8  # some samples exceed the cap
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"):
        assert m_fit[key] == pytest.approx(m_long[key], abs=1e-5), key
    for k in w_fit:
        torch.testing.assert_close(w_fit[k], w_long[k], atol=1e-5, rtol=0)


def test_kl_loss_with_reference_model_keeps_first_ppo_kl_zero(tmp_path):
    _, m = _run(tmp_path, 2, ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl"], "kl")
    assert m["train/first_mb_ppo_kl_abs_max"] == 0.0
    assert m["train/kl_loss"] == 0.0  # reference == actor before the first update


def test_cp2_update_equals_cp1(tmp_path):
    extra = ["--optimizer", "sgd", "--lr", "0.5", "--micro-batch-size", "2"]
    w1, m1 = _run(tmp_path, 1, extra, "cp1")
    w2, m2 = _run(tmp_path, 2, extra + ["--context-parallel-size", "2"], "cp2")
    assert m2["train/first_mb_ppo_kl_abs_max"] == 0.0
    # the first-step log-probs agree with the engine's (here: a plain forward) and hence with cp=1
    assert m2["train/train_rollout_logprob_abs_diff"] < 1e-5
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"):
        assert m1[key] == pytest.approx(m2[key], abs=1e-5), key
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)


def test_reference_model_follows_the_actor_with_ref_update_interval(tmp_path):
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3"]
    _, frozen = _run(tmp_path, 1, kl, "frozen", rollouts=2)
    _, updated = _run(tmp_path, 1, kl + ["--ref-update-interval", "1"], "updated", rollouts=2)
    assert frozen["train/kl_loss"] > 0.0  # the actor moved away from the initial reference
    assert updated["train/kl_loss"] == 0.0  # the reference took the actor's weights after rollout 0


VARIANTS = {
    "gspo_cpu_offload": ["--advantage-estimator", "gspo", "--fsdp-cpu-offload"],
    "rloo_grad_checkpointing": ["--advantage-estimator", "rloo", "--gradient-checkpointing"],
    "reinforce_pp_kl_reward": [
        "--advantage-estimator",
        "reinforce_plus_plus",
        "--kl-coef",
        "0.05",
        "--gamma",
        "0.9",
    ],
    "reinforce_pp_baseline": ["--advantage-estimator", "reinforce_plus_plus_baseline"],
    "dr_grpo_whitened": [
        "--disable-grpo-std-normalization",
        "--normalize-advantages",
        "--loss-reduction",
        "constant_sum",
    ],
    "tis_dual_clip_entropy": [
        "--use-tis",
        "--tis-clip",
        "1.5",
        "--eps-clip-c",
        "3",
        "--entropy-coef",
        "0.01",
    ],
    "mis_sequence_opsm": ["--use-mis", "--mis-level", "sequence", "--use-opsm"],
    "rollout_logprobs_token_mean": ["--use-rollout-logprobs", "--calculate-per-token-loss"],
    "custom_functions": [
        "--custom-advantage-function-path",
        "tests.integration.custom_fns:sign_advantage",
        "--custom-tis-function-path",
        "tests.integration.custom_fns:half_weights",
        "--custom-loss-function-path",
        "tests.integration.custom_fns.doubled_loss",
    ],
    "unbiased_kl_sgd_cosine": [
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.1",
        "--use-unbiased-kl",
        "--optimizer",
        "sgd",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "1",
        "--min-lr",
        "1e-4",
    ],
}


def _variants_body(rank: int, world: int, model_dir: str, out: str) -> None:
    from miles.backends.fsdp_utils.actor import FSDPTrainer

    samples = _rollout(model_dir)
    results = {}
    for name, extra in VARIANTS.items():
        trainer = FSDPTrainer(_config(model_dir, world, extra), rank, world)
        trainer.init("actor", with_ref="--use-kl-loss" in extra or "--kl-coef" in extra)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        metrics = trainer.train(0, samples)
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(trainer.model.parameters(), before))
        results[name] = {**metrics, "moved": moved}
    with open(out, "w") as f:
        json.dump(results, f)


def test_every_estimator_and_loss_option_trains(tmp_path):
    """One rollout per algorithm configuration through the real trainer (1 process): finite metrics, the
    metrics each option promises, an update that moves the weights, and ppo_kl == 0 on the first micro-batch."""
    model_dir = str(tmp_path / "model")
    save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / "variants.json")
    run_distributed(_variants_body, 1, model_dir, out, init_pg=False)
    with open(out) as f:
        results = json.load(f)
    expected_keys = {
        "tis_dual_clip_entropy": ["train/tis", "train/tis_clipfrac", "train/entropy_loss"],
        "mis_sequence_opsm": ["train/mis_masked_frac", "train/opsm_masked_frac"],
        "unbiased_kl_sgd_cosine": ["train/kl_loss"],
        "custom_functions": ["train/custom_weight", "train/doubled"],
    }
    for name, m in results.items():
        for key, value in m.items():
            assert value == value and abs(value) != float("inf"), (name, key, value)
        assert m["train/first_mb_ppo_kl_abs_max"] == 0.0, name
        assert m["moved"] > 0.0, name
        for key in ["train/loss", "train/pg_loss", "train/grad_norm", "train/ois"] + expected_keys.get(
            name, []
        ):
            assert key in m, (name, key)
    # cosine schedule with one warmup step: the first step runs at lr / 1 after warmup, then decays
    assert results["unbiased_kl_sgd_cosine"]["train/lr"] <= 1e-2


def _reuse_body(rank: int, world: int, model_dir: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.utils.seqlen_balancing import partition_samples_by_dp

    samples = _rollout(model_dir)
    parts = partition_samples_by_dp(
        [len(s.tokens) for s in samples], [s.group_index for s in samples], world, balance=False
    )
    cases = {
        "one_step": [],
        "one_step_tis_kl_loss": ["--use-tis", "--use-kl-loss", "--kl-loss-coef", "0.1", "--use-unbiased-kl"],
        "two_steps": ["--global-batch-size", "4"],
    }
    results = {}
    for name, extra in cases.items():
        runs = {}
        for reuse in (False, True):
            trainer = FSDPTrainer(_config(model_dir, world, extra), rank, world)
            trainer.init("actor", with_ref="--use-kl-loss" in extra)
            trainer.reuse_training_forward = reuse
            calls = []
            separate = trainer._log_probs
            trainer._log_probs = lambda model, *a, _f=separate, _c=calls: _c.append(model) or _f(model, *a)
            metrics = {}
            for rollout_id in range(2):
                metrics = trainer.train(rollout_id, [samples[i] for i in parts[rank]])
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(trainer.model, options=opts)
            old_passes = sum(m is trainer.model for m in calls)
            runs[reuse] = (metrics, {k: v.clone() for k, v in state.items()}, old_passes)
        (m0, w0, p0), (m1, w1, p1) = runs[False], runs[True]
        same_weights = all(torch.equal(w0[k], w1[k]) for k in w0)
        differ = {
            k: (m0[k], m1.get(k)) for k in m0 if not k.startswith(("timing/", "perf/")) and m0[k] != m1.get(k)
        }
        results[name] = {"passes": [p0, p1], "same_weights": same_weights, "differ": differ}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def test_old_log_probs_from_the_training_forward_equal_the_separate_pass(tmp_path):
    """With one optimizer step per rollout the old-log-prob pass is skipped (its numbers read off the training
    forward) and nothing changes bit for bit: metrics and weights after two rollouts, over DP=2; with two
    optimizer steps per rollout the separate pass still runs."""
    model_dir = str(tmp_path / "model")
    save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / "reuse.json")
    run_distributed(_reuse_body, 2, model_dir, out, init_pg=False)
    with open(out) as f:
        results = json.load(f)
    for name, r in results.items():
        assert r["same_weights"], name
        assert r["differ"] == {}, name
    assert results["one_step"]["passes"] == [2, 0]  # two rollouts: one separate pass each, then none
    assert results["one_step_tis_kl_loss"]["passes"] == [2, 0]
    assert results["two_steps"]["passes"] == [2, 2]
