"""`miles/ray/runtime_env_stub.py`, the runtime-env agent a local head miles starts for a run that asks for no
runtime env gets instead of Ray's: it persists the HTTP port the raylet waits for, answers Ray's requests (Ray's
own protobuf messages, over one kept-alive connection as the raylet sends them) with a failure naming the cause,
and exits once the raylet (its parent) is gone; on a real head, a task or actor with a runtime env fails at once
with that message while every other task runs."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import miles.ray
from tests.integration._util import wait_until_gone

STUB = Path(miles.ray.__file__).parent / "runtime_env_stub.py"
NODE = "cd" * 28


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> bytes:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/octet-stream"})
    reply = conn.getresponse()
    assert reply.status == 200
    return reply.read()


def test_the_stub_refuses_runtime_envs_over_http_and_exits_with_its_parent(tmp_path):
    from ray._raylet import wait_for_persisted_port
    from ray.core.generated import runtime_env_agent_pb2 as pb

    # its parent, a shell that exits once its stdin closes, stands for the raylet
    args = [sys.executable, "-u", "-S", str(STUB), f"--node-id={NODE}", "--node-ip-address=127.0.0.1",
            "--runtime-env-agent-port=0", f"--session-dir={tmp_path}", "--gcs-address=127.0.0.1:1"]  # fmt: skip
    parent = subprocess.Popen(
        ["sh", "-c", '"$@" </dev/null & echo $!; read line', "sh", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stub = int(parent.stdout.readline())
    try:
        # read by Ray's own reader, as the raylet reads it
        port = wait_for_persisted_port(str(tmp_path), NODE, "runtime_env_agent_port", 30000)
        assert port > 0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        asked = pb.GetOrCreateRuntimeEnvRequest(serialized_runtime_env='{"pip": ["x"]}', job_id=b"\x01\x00")
        for _ in range(2):  # the raylet keeps its connection open between requests
            reply = pb.GetOrCreateRuntimeEnvReply.FromString(
                _post(conn, "/get_or_create_runtime_env", asked.SerializeToString())
            )
            assert reply.status == 1  # AGENT_RPC_STATUS_FAILED
            assert "no runtime-env agent" in reply.error_message and '{"pip": ["x"]}' in reply.error_message
            assert "RAY_ADDRESS" in reply.error_message
        deleted = pb.DeleteRuntimeEnvIfPossibleReply.FromString(
            _post(conn, "/delete_runtime_env_if_possible", b"")
        )
        assert deleted.status == 0  # none was created: nothing to delete
        info = pb.GetRuntimeEnvsInfoReply.FromString(_post(conn, "/get_runtime_envs_info", b""))
        assert list(info.runtime_env_states) == []
        conn.close()
        time.sleep(1.5)  # a poll of its parent or more
        os.kill(stub, 0)  # still there while its parent lives
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
    wait_until_gone(stub, "the stub")


def _scripts_under(root: int) -> list[str]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    scripts, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                with open(f"/proc/{child}/cmdline") as f:
                    scripts.append(f.read().replace("\0", " "))
            except OSError:
                pass
    return scripts


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc"), reason="reads Linux /proc")
def test_a_head_without_runtime_envs_runs_tasks_and_refuses_a_runtime_env_at_once(monkeypatch):
    import ray

    from miles.ray.utils import init_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():  # an instance left by another module would not be this one
        ray.shutdown()

    def _pid() -> int:  # defined here: Ray ships it by value (this module is not importable in a worker)
        return os.getpid()

    assert init_ray(min_cpus=1, runtime_envs=False)
    try:
        scripts = _scripts_under(os.getpid())
        assert [s for s in scripts if "miles/ray/runtime_env_stub.py" in s], scripts
        assert not [s for s in scripts if "runtime_env/agent/main.py" in s], scripts
        assert ray.get(ray.remote(num_cpus=0)(_pid).remote(), timeout=60) != os.getpid()
        with_env = ray.remote(num_cpus=0, runtime_env={"env_vars": {"MILES_PROBE": "1"}})
        with pytest.raises(ray.exceptions.RuntimeEnvSetupError, match="no runtime-env agent"):
            ray.get(with_env(_pid).remote(), timeout=60)  # a failure, not the 60 s deadline

        class Probe:
            def pid(self) -> int:
                return os.getpid()

        with pytest.raises(ray.exceptions.RuntimeEnvSetupError, match="no runtime-env agent"):
            ray.get(with_env(Probe).remote().pid.remote(), timeout=60)
        assert ray.get(ray.remote(num_cpus=0)(Probe).remote().pid.remote(), timeout=60) != os.getpid()
    finally:
        ray.shutdown()
