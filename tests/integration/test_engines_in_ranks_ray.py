"""A colocated CPU run on a real Ray instance serves its embedded engines from the training ranks' processes
(`--cpu-engine-in-trainer`, the default): each engine's port is listened on by its rank's process, no engine
process or engine actor exists, the start-up refit (checksummed, bit for bit) and a rollout work, and shutdown
stops the servers."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from miles.config import parse_config
from miles.tools.tiny_model import build_tiny_model
from miles.tools.toy_data import make_rows, write_jsonl


def _listener_inode(port: int) -> str:
    """The socket inode listening on 127.0.0.1:`port` (from /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
                return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def _holds_socket(pid: int, inode: str) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    return any(os.readlink(os.path.join(fd_dir, fd)) == f"socket:[{inode}]" for fd in os.listdir(fd_dir))


def _engine_processes(model: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "miles.engines.local" in cmd and model in cmd:
            out.append(int(pid))
    return out


@pytest.mark.slow  # Ray, two trainers and a rollout (~30-70 s on 2 cores)
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc (Linux)")
def test_colocated_cpu_engines_run_inside_the_training_ranks(tmp_path):
    import ray

    from miles.ray.setup import build_system
    from miles.ray.utils import LocalActor

    model = build_tiny_model(tmp_path / "model", task="echo")
    data = write_jsonl(make_rows("echo", 32, seed=0), tmp_path / "echo.jsonl")
    cfg = parse_config([
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt",
        "--label-key", "label", "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "2", "--global-batch-size", "8",
        "--actor-num-gpus-per-node", "2", "--colocate", "--run-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    system = build_system(cfg)
    try:
        urls = system.engines.engine_urls
        ranks = system.train_group.workers
        key = {"Authorization": f"Bearer {system.cfg.engine.engine_api_key}"}  # the run's own key
        pids = ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in ranks])
        assert len(urls) == 2 and len(set(pids)) == 2
        for url, pid in zip(urls, pids, strict=True):
            assert _holds_socket(pid, _listener_inode(int(url.rsplit(":", 1)[1]))), (url, pid)
            # the start-up refit reached it (its checksums compared equal, or the build would have failed)
            info = httpx.get(url + "/model_info", headers=key, timeout=30).json()
            assert info["weight_version"] == "0", info
        assert not _engine_processes(str(model))  # no `python -m miles.engines.local` of this run
        # nor an engine fleet actor: the fleet, which only started the engines in the ranks, is the driver's
        assert isinstance(system.engines.fleet, LocalActor)
        live = [
            a for a in ray._private.state.actors().values() if a["State"] != "DEAD"
        ]  # an earlier test's too
        assert not [a for a in live if a["ActorClassName"] == "EngineFleet"]
        samples, _ = system.generate(0)
        assert len(samples) == 8 and all(s.response_length >= 1 for s in samples)
        ray.get(system.engines.fleet.shutdown.remote())  # the ranks live on; their servers stop
        for url in urls:
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0, url
        assert ray.get([w.__ray_call__.remote(lambda self: self.engine is None) for w in ranks]) == [True] * 2
    finally:
        system.shutdown()
