"""`miles/ray/agent_stub.py`, the dashboard agent a local head miles starts gets instead of Ray's: it persists the
ports Ray's minimal agent persists (-1: not served) under the names the raylet waits for, and exits once the
raylet (its parent) is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import miles.ray
from tests.integration._util import wait_until_gone

STUB = Path(miles.ray.__file__).parent / "agent_stub.py"
NODE = "ab" * 28


def test_the_stub_persists_the_minimal_agents_ports_and_exits_with_its_parent(tmp_path):
    # its parent, a shell that exits once its stdin closes, stands for the raylet
    args = [sys.executable, "-u", str(STUB), f"--node-id={NODE}", f"--session-dir={tmp_path}", "--minimal"]
    parent = subprocess.Popen(
        ["sh", "-c", '"$@" </dev/null & echo $!; read line', "sh", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stub = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    names = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
    while not all((tmp_path / f"{n}_{NODE}").exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}_{NODE}" for n in names)
    assert all((tmp_path / f"{n}_{NODE}").read_text() == "-1" for n in names)
    from ray._raylet import wait_for_persisted_port  # Ray's own reader agrees on the format

    assert wait_for_persisted_port(str(tmp_path), NODE, "metrics_agent_port", 5000) == -1
    time.sleep(1.5)  # a poll of its parent or more
    os.kill(stub, 0)  # still there while its parent lives
    parent.stdin.close()
    parent.wait(timeout=30)
    wait_until_gone(stub, "the stub")
