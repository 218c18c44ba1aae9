"""A refit under an in_place pause (issue 25): while a real embedded engine holds requests paused in place, a
refit that flushes the KV cache is refused (SGLang answers success=false), one with `flush_cache=False` loads,
through each transport (tensor handles, the shared-memory window, the gloo broadcast group); after
/continue_generation the held requests finish, their outputs spanning the old and the new weight versions."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.integration._util import run_distributed

N_REQUESTS, MAX_NEW = 4, 400  # long enough to still run when the pause comes


def _hold_requests(url: str) -> tuple[list[threading.Thread], list[dict]]:
    """Start N_REQUESTS long generations on threads; returns the threads and the list their answers go to."""
    import httpx

    answers: list[dict] = []

    def one(i: int) -> None:
        body = {
            "input_ids": [3 + i, 5, 7, 9],
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
        }
        answers.append(httpx.post(f"{url}/generate", json=body, timeout=120).json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_REQUESTS)]
    for t in threads:
        t.start()
    return threads, answers


def _body(rank: int, world: int, model_dir: str, url: str) -> None:
    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed
    from miles.refit.broadcast import DistributedWeightUpdater
    from miles.refit.session import RefitSetup
    from miles.refit.tensor_handles import ColocatedWeightUpdater
    from miles.refit.window import WindowWeightUpdater
    from miles.utils.engine_control_http import continue_generation, get_engine_json, pause_generation

    ps = init_distributed("gloo", timeout_s=120)
    model = build_fsdp_model(model_dir, ps.fsdp_mesh, device=torch.device("cpu"))
    setup = RefitSetup([url], ranks_per_engine=1, rank=rank, world_size=world, timeout_s=60, check_equal=True)
    broadcast = DistributedWeightUpdater(setup, "127.0.0.1", backend="gloo")
    broadcast.connect()
    updaters = {
        "tensor": ColocatedWeightUpdater(setup),
        "window": WindowWeightUpdater(setup),
        "bcast": broadcast,
    }
    for name, updater in updaters.items():
        updater.update(model, 1 << 14, f"{name}0", dtype=torch.float32)  # nothing held: flushing is fine
        threads, answers = _hold_requests(url)
        time.sleep(0.3)  # the requests are running
        pause_generation([url], "in_place", {}, 30)
        with pytest.raises(RuntimeError, match="flush"):  # requests held in place: a flushing update fails
            updater.update(model, 1 << 14, f"{name}1", dtype=torch.float32)
        updater.update(model, 1 << 14, f"{name}2", dtype=torch.float32, flush_cache=False)
        assert get_engine_json(url, "model_info", {}, 30, "version")["weight_version"] == f"{name}2"
        continue_generation([url], {}, 30)
        for t in threads:
            t.join(120)
        assert len(answers) == N_REQUESTS
        spans = [a["meta_info"]["weight_versions"] for a in answers]
        assert all(len(a["output_ids"]) == MAX_NEW for a in answers)
        # every held request's outputs came from two versions: the one before the pause, then the refit's
        assert any([s["version"] for s in sp] == [f"{name}0", f"{name}2"] for sp in spans), spans
    broadcast.disconnect()


def test_refit_under_in_place_pause_sends_no_flush(tmp_path):
    from miles.engines.sglang_engine import EngineProcess
    from miles.tools.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "model", seed=0))
    proc = EngineProcess(model_dir, kind="local", startup_timeout=120).launch()
    try:
        run_distributed(_body, 1, model_dir, proc.url, init_pg=False)
    finally:
        proc.shutdown()
