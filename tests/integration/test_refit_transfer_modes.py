"""Both refit transports of `--update-weight-transfer-mode` into real embedded engines, through `FSDPTrainer`:

- tensor, colocated on CPU: the shared-memory weight window (`WindowWeightUpdater`);
- broadcast, disaggregated: the update group over gloo, the engines receiving into their fused layout.

Each runs three refits from a 2-rank FSDP2 trainer into two engines with a training step before each: a full one,
one of a restarted engine alone (killed and started again on its port, as the health monitor does: its transport
is new), then a full one again; after each, every engine tensor equals the trainer's bit for bit (fp32) and the
engines serve the new version. Colocated refits go through the release/resume cycle of a colocated run.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import torch

from miles.utils.types import Sample, SampleStatus
from tests.integration._util import run_distributed


def _samples(seed: int, rank: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        tokens = torch.randint(3, 40, (9,), generator=g).tolist()
        out.append(
            Sample(
                index=i,
                group_index=i // 2,
                tokens=tokens,
                response_length=4,
                loss_mask=[1] * 4,
                rollout_log_probs=None,
                reward=float((i + seed) % 2),
                status=SampleStatus.COMPLETED,
            )
        )
    return out[2 * rank : 2 * rank + 2]


def _assert_engine_equals(url: str, state: dict[str, torch.Tensor], version: str) -> None:
    assert httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"] == version, url
    for name, tensor in state.items():
        got = httpx.post(
            f"{url}/get_weights_by_name", json={"name": name, "truncate_size": tensor.numel()}, timeout=60
        ).json()
        assert torch.equal(torch.tensor(got, dtype=torch.float32), tensor.flatten().float()), (url, name)


def _post(url: str, path: str, body: dict) -> None:
    resp = httpx.post(f"{url}/{path}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text


def _body(rank: int, world: int, model_dir: str, urls: list[str], pids: list[int], mode: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config
    from miles.engines.sglang_engine import EngineProcess

    colocated = mode == "tensor"
    placement = ["--colocate"] if colocated else ["--rollout-num-gpus", "2"]
    cfg = parse_config([
        "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "3",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--actor-num-gpus-per-node", str(world), *placement, "--lr", "1e-2",
        "--update-weight-transfer-mode", mode, "--check-weight-update-equal",
        "--update-weight-buffer-size", "4096",  # many buckets
    ])  # fmt: skip
    trainer = FSDPTrainer(cfg, rank, world)
    trainer.init("actor", with_ref=False)

    def full_state() -> dict[str, torch.Tensor]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {k: v.clone() for k, v in get_model_state_dict(trainer.model, options=opts).items()}

    def refit(targets: list[str], version: str) -> None:
        # the first refit reads each engine's window layout, which an engine answers right only while it holds
        # its weights: resumed before it (as a run's start-up refit does); later ones resume inside the refit,
        # each engine from the rank serving it
        first = trainer._refitter is None
        if colocated and rank == 0:  # a colocated step: the engines gave their weights back for training
            for url in targets:
                _post(url, "release_memory_occupation", {"tags": ["weights"]})
                if first:
                    _post(url, "resume_memory_occupation", {"tags": ["weights"]})
        dist.barrier()
        resume = ["weights"] if colocated and not first else []
        trainer.update_weights(targets, weight_version=version, resume_tags=resume)
        state = full_state()
        if rank == 0:
            for url in targets:
                _assert_engine_equals(url, state, version)

    restarted = None
    try:
        trainer.train(0, _samples(0, rank))
        refit(urls, "v1")
        updater = trainer._refitter.transport
        kind = type(updater).__name__
        assert kind == ("WindowWeightUpdater" if colocated else "DistributedWeightUpdater"), kind
        if rank == 0:  # engine 1 dies and comes back on its port, as the health monitor restarts it
            os.kill(pids[1], signal.SIGKILL)
            port = int(urls[1].rsplit(":", 1)[1])
            restarted = EngineProcess(model_dir, kind="local", port=port, startup_timeout=120).launch()
        dist.barrier()
        trainer.train(1, _samples(1, rank))
        refit([urls[1]], "v2")  # the restarted engine alone
        assert trainer._refitter.transport is updater
        trainer.train(2, _samples(2, rank))
        refit(urls, "v3")
    finally:
        if restarted is not None:
            restarted.shutdown()


@pytest.mark.parametrize("mode", ["tensor", "broadcast"])
def test_refit_transfer_modes_bit_equal_across_steps_and_a_restart(two_tiny_engines, mode):
    model_dir, procs = two_tiny_engines
    run_distributed(
        _body, 2, model_dir, [p.url for p in procs], [p.proc.pid for p in procs], mode, init_pg=False
    )


def _failure_body(rank: int, world: int, model_dir: str, urls: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed
    from miles.refit.session import RefitSetup
    from miles.refit.window import HOST_FLAGS_SUPPORTED, WindowWeightUpdater
    from miles.utils.engine_control_http import EngineMemoryControl

    ps = init_distributed("gloo", timeout_s=120)
    model = build_fsdp_model(model_dir, ps.fsdp_mesh, device=torch.device("cpu"))
    updater = WindowWeightUpdater(
        RefitSetup(urls, ranks_per_engine=1, rank=rank, world_size=world, timeout_s=60)
    )

    def refit(version: str) -> None:
        with torch.no_grad():  # new weights at every refit, so an engine left behind would differ
            for p in model.parameters():
                p.add_(0.01)
        updater.update(model, 1 << 20, version, dtype=torch.float32)

    refit("v1")
    assert (updater.flags is not None) == HOST_FLAGS_SUPPORTED
    load = updater._load
    if rank == 1:

        def failing(url: str, weight_version: str, checksums: dict[str, str] | None, *resume: object) -> None:
            raise ConnectionError(f"injected at {url}")

        updater._load = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"weight update failed: rank 1: ConnectionError: injected at "):
        refit("v2")
    updater._load = load  # type: ignore[method-assign]
    refit("v3")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        for url in urls:
            _assert_engine_equals(url, state, "v3")
        _post(urls[0], "release_memory_occupation", {"tags": ["weights"]})  # engine 1 keeps its weights
    dist.barrier()
    # each rank resumes its own engine: engine 1 refuses (nothing released), every rank raises before any load
    updater.resume_engines(
        urls, lambda targets: EngineMemoryControl(targets, None, 30).resume_memory(["weights"])
    )
    pattern = rf"weight update failed: rank 1: EngineStatusError: engine {urls[1]}, resume_memory_occupation"
    with pytest.raises(RuntimeError, match=pattern):
        refit("v4")
    if rank == 0:
        for url in urls:
            assert httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"] == "v3", url
    refit("v5")  # engine 0 was resumed by rank 0's call; no resume pending
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        for url in urls:
            _assert_engine_equals(url, state, "v5")
        _post(urls[0], "release_memory_occupation", {"tags": ["weights"]})
    dist.barrier()

    def unused(targets: list[str]) -> None:
        raise AssertionError("with the windows mapped, the tags travel with the load")

    # the tags go with each engine's load: engine 1 refuses (nothing released), every rank raises naming it
    updater.resume_engines(urls, unused, ["weights"])
    pattern = (
        rf"weight update failed: rank 1: EngineStatusError: engine {urls[1]}, update_weights_from_window"
    )
    with pytest.raises(RuntimeError, match=pattern):
        refit("v6")
    refit("v7")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        for url in urls:
            _assert_engine_equals(url, state, "v7")
    dist.barrier()


def test_window_refit_failure_raises_on_every_rank_and_the_next_refit_works(two_tiny_engines):
    """Rank 1's engine call fails in the second of three window refits: every rank raises naming rank 1 (the
    agreement after the loads, through the host's flags on x86), and the third refit, rounds still in step, leaves
    both engines equal to the trainer bit for bit. Then rank 1's resume of its engine fails (each rank resumes its
    own): every rank raises naming it before any engine loads, and the next refit works again."""
    model_dir, procs = two_tiny_engines
    run_distributed(_failure_body, 2, model_dir, [p.url for p in procs], init_pg=False)


def _one_trainer_body(rank: int, world: int, model_dir: str, urls: list[str]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.actor import FSDPTrainer
    from miles.config import parse_config

    cfg = parse_config([
        "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--check-weight-update-equal",
    ])  # fmt: skip
    trainer = FSDPTrainer(cfg, rank, world)
    trainer.init("actor", with_ref=False)
    trainer.train(0, _samples(0, 0) + _samples(0, 1))
    trainer.update_weights(urls, weight_version="v1")
    kind = type(trainer._refitter.transport).__name__
    assert kind == "DistributedWeightUpdater", kind
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {k: v.clone() for k, v in get_model_state_dict(trainer.model, options=opts).items()}
    for url in urls:
        _assert_engine_equals(url, state, "v1")


def test_auto_refit_of_two_disaggregated_engines_from_one_trainer_on_cpu(two_tiny_engines):
    """1 trainer + 2 engines disaggregated on CPU (`--placements 1+2` of scripts/bench/async.py): auto must not pick
    tensor handles, which give each engine training ranks of its own (it raised "2 colocated engines need 2
    training ranks"); it broadcasts over gloo, and both engines equal the trainer bit for bit."""
    model_dir, procs = two_tiny_engines
    run_distributed(_one_trainer_body, 1, model_dir, [p.url for p in procs], init_pg=False)
