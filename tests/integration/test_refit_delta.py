"""Delta refit (--update-weight-delta changed) over the gloo broadcast group into two real embedded engines, from a
2-rank FSDP2 model: after each refit both engines equal the trainer bit for bit (their `/weights_checker`
checksums against the trainer's, via `miles.refit.engine_endpoints`), tensors no engine lacks are not sent (counted),
and an engine that was restarted, or whose memory was released and resumed, gets everything.
"""

from __future__ import annotations

import os
import signal

import httpx
import torch

from tests.integration._util import run_distributed


def _body(rank: int, world: int, model_dir: str, urls: list[str], pids: list[int], out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.backends.fsdp_utils.model import build_fsdp_model
    from miles.backends.fsdp_utils.parallel import init_distributed
    from miles.engines.sglang_engine import EngineProcess
    from miles.refit.broadcast import DistributedWeightUpdater
    from miles.refit.buckets import hf_tensors
    from miles.refit.engine_endpoints import engine_checksums
    from miles.refit.session import RefitSetup
    from miles.utils.weight_checksum import tensor_checksum

    ps = init_distributed("gloo", timeout_s=120)
    model = build_fsdp_model(model_dir, ps.fsdp_mesh, device=torch.device("cpu"))
    setup = RefitSetup(urls, ranks_per_engine=1, rank=rank, world_size=world, timeout_s=60, check_equal=True)
    updater = DistributedWeightUpdater(setup, "127.0.0.1", backend="gloo", delta="changed")
    updater.connect()
    names = [e.name for e in hf_tensors(model, torch.float32)]
    layer0 = [n for n in names if ".layers.0." in n]
    assert 0 < len(layer0) < len(names)
    log = []

    def step(touch: list[str]) -> None:  # a training step that changes only the tensors in `touch`
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in touch:
                    p.add_(0.01)

    def refit(version: str, targets: list[str] | None = None) -> int:
        updater.update(model, 4096, version, dtype=torch.float32, engines=targets)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        sent = int(updater.last_metrics.get("perf/refit_tensors_sent", -1)) if rank == 0 else -1
        if rank == 0:
            trainer = {n: tensor_checksum(t.float()) for n, t in state.items()}
            for url in targets or urls:
                (engine,) = engine_checksums(url, {}, 60, version)  # one TP rank per embedded engine
                differ = [n for n in names if engine.get(n) != trainer[n]]  # tied tensors once
                assert not differ, (url, version, differ[:5])
            log.append({"version": version, **updater.last_metrics})
        dist.barrier()
        return sent

    restarted = None
    try:
        assert refit("v1") in (len(names), -1)  # fresh engines: everything
        step(layer0)
        assert refit("v2") in (len(layer0), -1)  # only layer 0 changed
        assert refit("v3") in (0, -1)  # nothing changed: only the version moves
        if rank == 0:  # engine 1 dies and comes back on its port, as the health monitor restarts it
            os.kill(pids[1], signal.SIGKILL)
            port = int(urls[1].rsplit(":", 1)[1])
            restarted = EngineProcess(model_dir, kind="local", port=port, startup_timeout=120).launch()
        dist.barrier()
        updater.engines_restarted([urls[1]])
        step(layer0)
        assert refit("v4") in (len(names), -1)  # the restarted engine gets everything (so the group does)
        step(layer0[:1])
        assert refit("v5") in (1, -1)
        if rank == 0:  # engine 0's memory is released and resumed: it declares nothing intact
            for path in ("release_memory_occupation", "resume_memory_occupation"):
                resp = httpx.post(f"{urls[0]}/{path}", json={"tags": ["weights"]}, timeout=60)
                assert resp.status_code == 200, resp.text
            info = httpx.get(f"{urls[0]}/get_server_info", timeout=30).json()
            assert info["refit_delta_version"] is None, info
        dist.barrier()
        assert refit("v6") in (len(names), -1)
        assert refit("v7", [urls[1]]) in (0, -1)  # engine 1 alone (a regroup): it holds v6 already
        assert refit("v8") in (0, -1)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(log, f)
    finally:
        updater.disconnect()
        if restarted is not None:
            restarted.shutdown()


def test_delta_refit_sends_only_changes_and_leaves_engines_bit_equal(two_tiny_engines, tmp_path):
    import json

    model_dir, procs = two_tiny_engines
    out = str(tmp_path / "log.json")
    run_distributed(
        _body, 2, model_dir, [p.url for p in procs], [p.proc.pid for p in procs], out, init_pg=False
    )
    log = json.load(open(out))
    assert [e["version"] for e in log] == [f"v{i}" for i in range(1, 9)]
    full = log[0]["perf/refit_bytes_full"]
    assert log[0]["perf/refit_bytes"] == full > log[1]["perf/refit_bytes"] > 0 == log[2]["perf/refit_bytes"]
