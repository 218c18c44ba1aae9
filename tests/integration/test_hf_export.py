"""HF export on 2 gloo CPU ranks: --save-hf and the DCP converter give a directory that transformers loads with the
trainer's logits (fp32, <= 1e-6) and the embedded engine serves with the same log-probs; --ref-load of a DCP
checkpoint gives the reference the checkpoint's weights."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from tests.integration._util import run_distributed

PROBE = [[5, 9, 12, 3, 7, 7, 20], [30, 2, 11]]  # token ids the logits are compared on


def _rollout(vocab: int, seed: int = 0) -> list:
    from miles.utils.types import Sample, SampleStatus

    rng = random.Random(seed)
    samples = []
    for g in range(4):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))]
        for k in range(2):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 4))]
            samples.append(
                Sample(
                    index=len(samples),
                    group_index=g,
                    tokens=prompt + response,
                    response_length=len(response),
                    loss_mask=[1] * len(response),
                    rollout_log_probs=[-1.0] * len(response),
                    reward=float(k),
                    status=SampleStatus.COMPLETED,
                )
            )
    return samples


def _config(model_dir: str, root: str, extra: list[str]):
    from miles.config import parse_config

    return parse_config(
        ["--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "2"]
        + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8"]
        + ["--actor-num-gpus-per-node", "2", "--colocate", "--lr", "5e-2", "--seed", "3"]
        + ["--run-dir", root, "--update-weight-buffer-size", "20000"]
        + extra
    )


def _probe_logits(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0].detach().clone() for ids in PROBE]


def _body(rank: int, world: int, model_dir: str, root: str) -> None:
    from miles.backends.fsdp_utils.actor import FSDPTrainer

    samples = _rollout(48)
    mine = [s for s in samples if s.group_index % world == rank]
    ckpt, hf = os.path.join(root, "ckpt"), os.path.join(root, "hf")
    trainer = FSDPTrainer(_config(model_dir, root, ["--save", ckpt, "--save-hf", hf]), rank, world)
    trainer.init("actor", with_ref=False)
    trainer.train(0, mine)
    trainer.save(0)
    trainer.save_hf(0)
    logits = _probe_logits(trainer.model)  # a collective forward on every rank; rank 0 keeps the result

    # --ref-load of the checkpoint, resumed from the same checkpoint: reference == policy, so KL is exactly 0
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.1", "--load", ckpt]
    same = FSDPTrainer(_config(model_dir, root, kl + ["--ref-load", ckpt]), rank, world)
    assert same.init("actor", with_ref=True) == 1
    ref = dict(same.ref_model.named_parameters())
    ref_equal = all(torch.equal(p.to_local(), ref[n].to_local()) for n, p in same.model.named_parameters())
    m_same = same.train(1, mine)
    if rank == 0:
        torch.save(logits, os.path.join(root, "trainer_logits.pt"))
        with open(os.path.join(root, "kl.json"), "w") as f:
            json.dump({"kl_loss": m_same["train/kl_loss"], "ref_equal": ref_equal}, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from miles.tools.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("hf_export")
    model_dir = build_tiny_model(root / "model", task="echo", seed=0, hidden_size=32)
    run_distributed(_body, 2, str(model_dir), str(root), init_pg=False)
    return root


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_save_hf_loads_with_the_trainers_logits(trained):
    from transformers import AutoTokenizer

    out = trained / "hf" / "iter_0000000"
    names = sorted(p.name for p in out.iterdir())
    for f in ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert f in names, names
    assert "model-00001-of-00001.safetensors" in names
    assert not (trained / "hf" / "iter_0000000.tmp").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    AutoTokenizer.from_pretrained(out)
    expected = torch.load(trained / "trainer_logits.pt")
    model = _load(out)
    got = _probe_logits(model)
    for e, g in zip(expected, got):
        assert (e - g).abs().max().item() <= 1e-6
    base = _probe_logits(_load(trained / "model"))
    assert (base[0] - got[0]).abs().max().item() > 1e-4, "the export still holds the untrained weights"


def test_converter_matches_save_hf_and_shards(trained, tmp_path):
    from safetensors.torch import load_file

    from miles.tools.convert_to_hf import main

    out = tmp_path / "conv"
    assert main(["--checkpoint", str(trained / "ckpt"), "--out", str(out), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embeddings: stored once
    converted = {k: v for f in files for k, v in load_file(out / f).items()}
    live_dir = trained / "hf" / "iter_0000000"
    live = load_file(live_dir / "model-00001-of-00001.safetensors")
    assert converted.keys() == live.keys()
    for k in live:
        assert torch.equal(converted[k], live[k]), k

    bf16 = tmp_path / "bf16"
    assert (
        main(
            [
                "--checkpoint",
                str(trained / "ckpt" / "iter_0000000"),
                "--out",
                str(bf16),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    halves = load_file(bf16 / "model-00001-of-00001.safetensors")
    for k in live:
        assert halves[k].dtype == torch.bfloat16 and torch.equal(halves[k], live[k].to(torch.bfloat16)), k


def test_converter_refuses_bad_input(trained, tmp_path, capsys):
    import shutil

    from miles.tools.convert_to_hf import main

    assert main(["--checkpoint", str(trained / "model"), "--out", str(tmp_path / "x")]) == 2
    assert "not a DCP checkpoint" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "f").write_text("x")
    assert main(["--checkpoint", str(trained / "ckpt"), "--out", str(taken)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # a checkpoint without hf/ (written before HF export existed) needs the source model named
    bare = tmp_path / "bare"
    shutil.copytree(trained / "ckpt" / "iter_0000000", bare)
    shutil.rmtree(bare / "hf")
    assert main(["--checkpoint", str(bare), "--out", str(tmp_path / "y")]) == 2
    assert "--hf-checkpoint" in capsys.readouterr().err
    assert (
        main(
            [
                "--checkpoint",
                str(bare),
                "--out",
                str(tmp_path / "y"),
                "--hf-checkpoint",
                str(trained / "model"),
            ]
        )
        == 0
    )


def test_ref_load_of_a_dcp_checkpoint(trained):
    kl = json.loads((trained / "kl.json").read_text())
    # the reference holds the checkpoint's weights (which differ from --hf-checkpoint's: see the logits test)
    assert kl["ref_equal"] is True
    assert kl["kl_loss"] == 0.0


def test_embedded_engine_serves_the_export_with_the_trainers_log_probs(trained):
    from miles.algo.logprobs import compute_log_probs
    from miles.engines.sglang_engine import EngineProcess

    out = trained / "hf" / "iter_0000000"
    model = _load(out)
    prompt = PROBE[0]
    with EngineProcess(str(out), kind="local", local_args={"num-threads": 1}) as engine:
        body = engine.post(
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True},
                "return_logprob": True,
            },
            timeout=120,
        )
    entries = body["meta_info"]["output_token_logprobs"]
    response = [int(e[1]) for e in entries]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    expected = compute_log_probs(logits[len(prompt) - 1 : -1], torch.tensor(response), 0.7)
    got = torch.tensor([float(e[0]) for e in entries])
    assert (expected - got).abs().max().item() <= 1e-5
