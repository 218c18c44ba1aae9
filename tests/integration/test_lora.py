"""LoRA on the FSDP2 policy without Ray: adapter-only optimizer state, the frozen base as reference, merged refit
tensors bit-equal to W + s*B@A (and the model they make equal to the adapted one), CP=2 equals CP=1, resume."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.integration._util import run_distributed, save_tiny_qwen3
from tests.integration.test_fsdp_trainer import VOCAB, _config, _rollout

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "0.05"]


def _lora_body(rank: int, world: int, model_dir: str, out: str, extra: list[str]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.backends.fsdp_utils.lora import MergedView, adapter_parameter_names, merged_weight
    from miles.refit.buckets import iter_weight_buckets
    from miles.utils.seqlen_balancing import partition_samples_by_dp

    samples = _rollout(model_dir)
    cfg = _config(model_dir, world, LORA + extra)
    cp = cfg.train.context_parallel_size
    parts = partition_samples_by_dp(
        [len(s.tokens) for s in samples], [s.group_index for s in samples], world // cp, balance=False
    )
    mine = [samples[i] for i in parts[rank // cp]]
    trainer = FSDPTrainer(cfg, rank, world)
    trainer.init("actor", with_ref="--use-kl-loss" in extra)
    m0 = trainer.train(0, mine)
    m1 = trainer.train(1, mine)
    # the optimizer holds state for the adapters only
    adapters = {id(p) for n, p in trainer.model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert held and all(id(p) in adapters for p in held), "optimizer holds non-adapter parameters"
    assert all(id(p) in adapters for p in trainer.optimizer.state), "optimizer state for base weights"
    if cfg.optim.optimizer == "adam":  # SGD without momentum keeps no state at all
        assert len(trainer.optimizer.state) == len(adapters)
    # refit tensors: bit-equal to W + s*B@A, under base names, no adapter tensors
    buckets = [b for b in iter_weight_buckets(MergedView(trainer.model), 4096, torch.float32)]
    sent = {name: t.clone() for b in buckets for name, t in b}
    layers = {n: m for n, m in trainer.model.named_modules() if hasattr(m, "lora_A")}
    expected = {f"{n}.weight": merged_weight(m) for n, m in layers.items()}
    state = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        assert not any("lora" in name for name in sent)
        for name, t in expected.items():
            assert torch.equal(sent[name], t), name
        torch.save({"sent": sent, "state": {k: v.clone() for k, v in state.items()}}, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump({"m0": m0, "m1": m1, "adapters": adapter_parameter_names(trainer.model)}, f)


def _run(tmp_path, world: int, extra: list[str], name: str):
    model_dir = str(tmp_path / "model")
    if not os.path.exists(model_dir):
        save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / name)
    run_distributed(_lora_body, world, model_dir, out, extra, init_pg=False)
    with open(out + ".json") as f:
        return torch.load(out + ".pt"), json.load(f)


def _refit_names(model) -> set[str]:
    """The names a refit of the plain (un-adapted) model sends (tied tensors once)."""
    from miles.refit.buckets import iter_weight_buckets

    return {name for bucket in iter_weight_buckets(model, 1 << 20) for name, _ in bucket}


def _packed_log_probs(model, samples):
    from miles.algo.logprobs import compute_log_probs

    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0]
            n = s.response_length
            out.append(compute_log_probs(logits[-n - 1 : -1], torch.tensor(s.tokens[-n:]), 0.8))
    return out


def test_lora_trains_adapters_only_and_refits_merged_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    tensors, m = _run(tmp_path, 2, ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3"], "dp2")
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).state_dict()
    state = tensors["state"]
    # base weights never move; the adapters do
    for k, v in base.items():
        assert torch.equal(state[k], v), k
    assert any(k.endswith("lora_B") and state[k].abs().sum() > 0 for k in state)
    assert m["m0"]["train/first_mb_ppo_kl_abs_max"] == 0.0
    assert m["m0"]["train/kl_loss"] == 0.0  # reference = base = policy before its first update (B = 0)
    assert m["m1"]["train/kl_loss"] > 0.0  # the adapters moved the policy away from the base
    # the merged tensors make a plain HF model compute what the adapted trainer model computes
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    merged.load_state_dict(tensors["sent"], strict=False)
    assert set(tensors["sent"]) == _refit_names(merged)
    samples = _rollout(str(tmp_path / "model"))
    plain = _packed_log_probs(AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")), samples)
    after = _packed_log_probs(merged, samples)
    assert any(
        not torch.allclose(a, b, atol=1e-4) for a, b in zip(plain, after)
    )  # the refit carries the update


def test_lora_cp2_equals_cp1(tmp_path):
    extra = ["--optimizer", "sgd", "--lr", "0.5", "--micro-batch-size", "2"]
    t1, m1 = _run(tmp_path, 1, extra, "cp1")
    t2, m2 = _run(tmp_path, 2, extra + ["--context-parallel-size", "2"], "cp2")
    for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert m1["m1"][key] == pytest.approx(m2["m1"][key], abs=1e-5), key
    for k in t1["state"]:
        torch.testing.assert_close(t1["state"][k], t2["state"][k], atol=1e-5, rtol=0)


def _refit_loop_body(rank: int, world: int, model_dir: str, out: str) -> None:
    """Step-0 check after a refit, many times: the no-grad forward right after materialising the merged tensors
    equals the one before (the merge never writes into, or aliases, a weight a forward reads)."""
    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.backends.fsdp_utils.lora import MergedView
    from miles.refit.buckets import iter_weight_buckets

    torch.set_num_threads(2)  # the intra-op pool a racing in-place merge would show up with
    samples = _rollout(model_dir)
    trainer = FSDPTrainer(_config(model_dir, world, LORA), rank, world)
    trainer.init("actor", with_ref=False)
    torch.set_num_threads(2)
    trainer.train(0, samples)  # B != 0 from here on
    from miles.backends.fsdp_utils import rollout_batch as rb

    batch = rb.RankBatch.from_samples(samples, trainer.ps.device)
    steps = rb.plan_steps(batch, trainer.config, trainer.ps, trainer.steps_per_rollout)
    with torch.no_grad():
        before = trainer._log_probs(trainer.model, batch, steps)
    sent = {}
    for _ in range(24):
        for bucket in iter_weight_buckets(MergedView(trainer.model), 2048, torch.float32):
            sent.update((name, t.clone()) for name, t in bucket)
        with torch.no_grad():
            now = trainer._log_probs(trainer.model, batch, steps)
        assert all(torch.equal(a, b) for a, b in zip(before, now))
    torch.save({"sent": sent, "log_probs": before}, out)


def test_lora_forward_after_refit_is_unchanged_many_times(tmp_path):
    """...and an engine-side model loaded with the refit's merged tensors computes the adapted model's log-probs."""
    from transformers import AutoModelForCausalLM

    model_dir = str(tmp_path / "model")
    save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = tmp_path / "loop.pt"
    run_distributed(_refit_loop_body, 1, model_dir, str(out), init_pg=False)
    r = torch.load(out)
    engine = AutoModelForCausalLM.from_pretrained(model_dir)
    assert set(r["sent"]) == _refit_names(engine)
    engine.load_state_dict(r["sent"], strict=False)  # tied tensors travel once, as for a full fine-tune
    got = _packed_log_probs(engine, _rollout(model_dir))
    for a, b in zip(got, r["log_probs"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def _resume_body(rank: int, world: int, model_dir: str, save_dir: str, out: str) -> None:
    from miles.backends.fsdp_utils.actor import FSDPTrainer

    samples = _rollout(model_dir)
    straight = FSDPTrainer(_config(model_dir, world, LORA + ["--save", save_dir]), rank, world)
    straight.init("actor", with_ref=False)
    straight.train(0, samples)
    straight.save(0)
    want = straight.train(1, samples)
    resumed = FSDPTrainer(_config(model_dir, world, LORA + ["--load", save_dir]), rank, world)
    assert resumed.init("actor", with_ref=False) == 1
    got = resumed.train(1, samples)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"want": want, "got": got}, f)


def test_lora_checkpoint_resumes(tmp_path):
    model_dir = str(tmp_path / "model")
    save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    out = str(tmp_path / "resume.json")
    run_distributed(_resume_body, 1, model_dir, str(tmp_path / "ckpt"), out, init_pg=False)
    with open(out) as f:
        r = json.load(f)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert r["got"][key] == r["want"][key], key
    # the checkpoint holds the adapters (and their optimizer state), not the frozen base weights
    import torch.distributed.checkpoint as dcp

    keys = set(
        dcp.FileSystemReader(str(tmp_path / "ckpt" / "iter_0000000")).read_metadata().state_dict_metadata
    )
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys), sorted(model_keys)[:5]


def _export_body(rank: int, world: int, model_dir: str, save_dir: str, out: str) -> None:
    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.refit.buckets import iter_weight_buckets

    samples = _rollout(model_dir)
    trainer = FSDPTrainer(_config(model_dir, world, LORA + ["--save", save_dir]), rank, world)
    trainer.init("actor", with_ref=False)
    trainer.train(0, samples)
    trainer.train(1, samples)
    trainer.save(1)
    # what a refit of the trained policy sends (fp32): the merged export must hold exactly these tensors
    sent = {
        n: t.clone()
        for b in iter_weight_buckets(trainer._refit_source(), 1 << 20, torch.float32)
        for n, t in b
    }
    if rank == 0:
        torch.save(sent, out)


def test_lora_hf_export_merged_and_adapter(tmp_path, capsys):
    """convert_to_hf of a LoRA checkpoint: --lora-export merged (default) and adapter."""
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.lora import merge
    from miles.backends.fsdp_utils.lora_export import read_adapter
    from miles.tools.convert_to_hf import main as convert

    model_dir = str(tmp_path / "model")
    save_tiny_qwen3(model_dir, vocab_size=VOCAB)
    ckpt = tmp_path / "ckpt"
    run_distributed(_export_body, 1, model_dir, str(ckpt), str(tmp_path / "sent.pt"), init_pg=False)
    sent = torch.load(tmp_path / "sent.pt")

    # merged: a plain HF model whose weights are bit-equal to the trainer's merged (refit) weights
    assert convert(["--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(sent) <= set(merged)
    for name, t in sent.items():
        assert torch.equal(merged[name], t), name
    assert any(not torch.equal(merged[k], base[k]) for k in sent)  # the adapters moved the weights

    # adapter: peft's layout and config; read back, it rebuilds the merged weights from the base
    out = tmp_path / "adapter"
    assert convert(["--checkpoint", str(ckpt), "--out", str(out), "--lora-export", "adapter"]) == 0
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    config, adapters = read_adapter(out)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["base_model_name_or_path"] == os.path.abspath(model_dir)
    assert set(config["target_modules"]) == {n.rsplit(".", 1)[-1] for n in adapters}
    assert len(adapters) == sum(1 for k in sent if k.endswith("proj.weight"))
    for module, (a, b) in adapters.items():
        assert a.shape[0] == b.shape[1] == 4
        w = base[f"{module}.weight"]
        assert torch.equal(merge(w, a, b, config["lora_alpha"] / config["r"]), merged[f"{module}.weight"]), (
            module
        )

    # without its adapter_config.json the checkpoint's lora_alpha is unknown: a clear refusal, not a guess
    os.remove(ckpt / "iter_0000001" / "adapter_config.json")
    capsys.readouterr()
    assert convert(["--checkpoint", str(ckpt), "--out", str(tmp_path / "x")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
