"""A refit whose bytes are corrupted on the way to a real embedded engine fails, naming the engine, the tensor and
the weight version: the trainer hashed what it sent before the corruption (checksums are on by default), the
engine hashes what it received. One training rank and one engine, through each transport: tensor handles
(colocated), the shared-memory weight window (colocated on CPU) and the broadcast group (gloo)."""

from __future__ import annotations

import pytest
import torch

from tests.integration._util import run_distributed

BAD = "model.layers.0.mlp.down_proj.weight"


def _corrupt(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t + 1 if n == BAD else t) for n, t in bucket]


def _body(rank: int, world: int, model_dir: str, url: str) -> None:
    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed
    from miles.refit.broadcast import DistributedWeightUpdater
    from miles.refit.session import RefitSetup
    from miles.refit.tensor_handles import ColocatedWeightUpdater
    from miles.refit.window import WindowWeightUpdater

    ps = init_distributed("gloo", timeout_s=120)
    model = build_fsdp_model(model_dir, ps.fsdp_mesh, device=torch.device("cpu"))
    setup = RefitSetup([url], ranks_per_engine=1, rank=rank, world_size=world, timeout_s=60, check_equal=True)

    colocated = ColocatedWeightUpdater(setup)
    colocated.update(model, 1 << 14, "c1", dtype=torch.float32)  # intact: the checksums agree
    assert colocated.checks is not None and colocated.checks.reported and colocated.checks.seconds > 0
    send = colocated._send_bucket
    colocated._send_bucket = lambda b, i, last, v: send(_corrupt(b), i, last, v)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=rf"engine {url}: after refit to weight version c2, 1 of \d+ tensors "
                       rf"differ from the trainer's \(checksum\): {BAD}"):  # fmt: skip
        colocated.update(model, 1 << 14, "c2", dtype=torch.float32)

    broadcast = DistributedWeightUpdater(setup, "127.0.0.1", backend="gloo")
    broadcast.connect()
    broadcast.update(model, 1 << 14, "b1", dtype=torch.float32)
    cast = broadcast._broadcast
    broadcast._broadcast = lambda b, i, last, v: cast(_corrupt(b), i, last, v)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=rf"weight version b2, 1 of \d+ tensors differ .*: {BAD}"):
        broadcast.update(model, 1 << 14, "b2", dtype=torch.float32)
    broadcast.disconnect()

    window = WindowWeightUpdater(setup)
    window.update(model, 1 << 14, "w1", dtype=torch.float32)
    checksums = window._checksums

    def corrupt_after_hashing(u, job, entries):  # the trainer hashed its window, then a byte flips in it
        checks = checksums(u, job, entries)
        window.windows[u].views[BAD].add_(1)
        return checks

    window._checksums = corrupt_after_hashing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=rf"weight version w2, 1 of \d+ tensors differ .*: {BAD}"):
        window.update(model, 1 << 14, "w2", dtype=torch.float32)


def test_corrupted_refit_names_engine_tensor_and_version(tmp_path):
    from miles.engines.sglang_engine import EngineProcess
    from miles.tools.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "model", seed=0))
    proc = EngineProcess(model_dir, kind="local", startup_timeout=120).launch()
    try:
        run_distributed(_body, 1, model_dir, proc.url, init_pg=False)
    finally:
        proc.shutdown()
