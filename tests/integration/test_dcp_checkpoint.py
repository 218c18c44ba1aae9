"""DCP checkpoints on 2 gloo CPU ranks: save -> fresh load -> step equals no save; atomic tracker protocol."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import run_distributed, save_tiny_qwen3

import miles.backends.fsdp_utils.checkpoint as ckpt
from miles.backends.fsdp_utils.checkpoint import TRACKER_FILE, load_checkpoint, read_tracker, save_checkpoint
from miles.backends.fsdp_utils.hf_load import load_hf_model
from miles.backends.fsdp_utils.lr_scheduler import build_lr_scheduler
from miles.backends.fsdp_utils.model import build_fsdp_model, build_optimizer

VOCAB = 96


def _setup(path: str, mesh):
    model = build_fsdp_model(path, mesh)
    opt = build_optimizer(model.parameters(), "adam", lr=1e-3, weight_decay=0.01)
    sched = build_lr_scheduler(
        opt, lr=1e-3, min_lr=1e-4, decay_style="cosine", total_iters=10, warmup_iters=2
    )
    return model, opt, sched


def _step(model, opt, sched, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=g)
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss = loss + 1e-3 * torch.randn(()).item()  # consumes torch RNG: a restored RNG must replay it
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def _save_load_body(rank: int, world_size: int, path: str, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(100 + rank)
    model, opt, sched = _setup(path, mesh)
    assert load_checkpoint(root, model, opt, sched) is None  # no tracker yet

    _step(model, opt, sched, rank, seed=1)
    final = save_checkpoint(root, 3, model, opt, sched, extra_state={"cursor": 7, "epoch": [1, 2]})
    assert final == Path(root) / "iter_0000003" and read_tracker(root) == 3
    draws = _draws()
    _step(model, opt, sched, rank, seed=2)
    expected, expected_lr = _full(model), sched.get_last_lr()

    # A save that dies half-way (after some shards are written) must leave the tracker and iter_0000003 alone,
    # remove its partial .tmp and raise on every rank, naming the checkpoint.
    real_save = ckpt.dcp.save

    def crashing_save(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        raise OSError("disk full (simulated)")

    ckpt.dcp.save = crashing_save
    with pytest.raises(
        RuntimeError, match=r"iter_0000005 failed on rank \d: OSError: disk full \(simulated\)"
    ):
        save_checkpoint(root, 5, model, opt, sched, extra_state={"cursor": 99})
    ckpt.dcp.save = real_save
    torch.distributed.barrier()
    assert read_tracker(root) == 3
    assert not (Path(root) / "iter_0000005.tmp").exists() and not (Path(root) / "iter_0000005").exists()

    # Fresh model/optimizer/scheduler and scrambled RNG: load, then the next step must equal the unsaved run.
    torch.manual_seed(12345)
    random.seed(1)
    np.random.seed(1)
    model2, opt2, sched2 = _setup(path, mesh)
    info = load_checkpoint(root, model2, opt2, sched2)
    assert info == {"next_rollout_id": 4, "extra_state": {"cursor": 7, "epoch": [1, 2]}}
    assert sched2.num_steps == 1
    got_draws = _draws()
    assert got_draws[:2] == draws[:2] and torch.equal(got_draws[2], draws[2])
    _step(model2, opt2, sched2, rank, seed=2)
    assert sched2.get_last_lr() == expected_lr
    for name, p in _full(model2).items():
        diff = (p - expected[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: resumed step differs from uninterrupted step by {diff}"

    # keep_last prunes older checkpoints after the tracker moves.
    save_checkpoint(root, 5, model2, opt2, sched2, extra_state={"cursor": 8}, keep_last=1)
    names = sorted(p.name for p in Path(root).iterdir())
    assert names == ["iter_0000005", TRACKER_FILE], names


def test_save_load_resume_and_atomicity(tmp_path) -> None:
    path = save_tiny_qwen3(str(tmp_path / "tiny"), vocab_size=VOCAB)
    root = tmp_path / "ckpt"
    run_distributed(_save_load_body, 2, path, str(root))

    # Resharding + world-size change: the 2-rank checkpoint loads into a plain single-process model
    # (no optimizer, no scheduler); RNG is left alone because the world size differs.
    torch.manual_seed(5)
    before = torch.get_rng_state()
    plain = load_hf_model(path)
    info = load_checkpoint(root, plain, None, None)
    assert info == {"next_rollout_id": 6, "extra_state": {"cursor": 8}}
    assert torch.equal(torch.get_rng_state(), before)
    original = load_hf_model(path)
    changed = [n for n, p in plain.named_parameters() if not torch.equal(p, original.get_parameter(n))]
    assert len(changed) == len(list(plain.parameters())), "not every tensor was restored from the checkpoint"


def test_tracker_errors(tmp_path) -> None:
    assert read_tracker(tmp_path) is None
    (tmp_path / TRACKER_FILE).write_text("abc\n")
    with pytest.raises(ValueError, match="'abc'"):
        read_tracker(tmp_path)
    (tmp_path / TRACKER_FILE).write_text("9\n")
    with pytest.raises(FileNotFoundError, match="iter_0000009"):
        load_checkpoint(tmp_path, torch.nn.Linear(2, 2), None, None)
    # a re-save of id 9 that crashed after moving the old copy aside: the old copy is still found
    saved = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path, 9, saved, None, None, extra_state={"cursor": 3})
    (tmp_path / "iter_0000009").rename(tmp_path / "iter_0000009.old")
    fresh = torch.nn.Linear(2, 2)
    assert load_checkpoint(tmp_path, fresh, None, None) == {
        "next_rollout_id": 10,
        "extra_state": {"cursor": 3},
    }
    assert torch.equal(fresh.weight, saved.weight)
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), None, None, keep_last=0)
