"""The driver's local Ray instance: it listens on loopback only, and a training rank that hangs or dies in a
phase (here: save) is named by its rank and the phase; a hang leaves every process's stacks in the run's logs.

One Ray instance for the module (started as the driver starts it, `miles.ray.utils.init_ray`); the training
workers are stand-ins (`tests.e2e.faults.StuckTrainWorker`) with the real `RayTrainGroup` fan-out around them.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from miles.ray.utils import init_ray

    if ray.is_initialized():  # an instance left by another module would not be the driver's
        ray.shutdown()
    init_ray(min_cpus=2)
    yield ray
    ray.shutdown()


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _listening(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, local address in hex as /proc/net/tcp* writes it) of every listening TCP socket of `pids`."""
    inodes: dict[str, str] = {}
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    inodes[fields[9]] = fields[1].rsplit(":", 1)[0]
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                found.append((pid, inodes[target[8:-1]]))
    return found


# 127.0.0.1, ::1, ::ffff:127.0.0.1 (an IPv6 socket bound to the IPv4 loopback)
LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc")
def test_local_ray_listens_on_loopback_only(local_ray):
    from miles.ray.utils import get_node_ip

    assert get_node_ip() == "127.0.0.1"
    assert local_ray.get(local_ray.remote(num_cpus=0)(get_node_ip).remote(), timeout=60) == "127.0.0.1"
    sockets = _listening(_descendants(os.getpid()))
    assert sockets, "found no listening socket of the Ray processes"
    public = [(pid, addr) for pid, addr in sockets if addr not in LOOPBACK_HEX]
    assert not public, public


def _script(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def test_local_ray_starts_no_autoscaler_monitor_api_server_log_monitor_or_dashboard_agent(local_ray, capsys):
    import threading
    import time

    from ray._private import node, services

    scripts = [_script(pid) for pid in _descendants(os.getpid())]
    assert not [s for s in scripts if "log_monitor.py" in s], scripts  # a thread of the driver instead
    assert not [s for s in scripts if "dashboard/agent.py" in s], scripts
    assert [s for s in scripts if "miles/ray/agent_stub.py" in s], scripts  # the raylet's stand-in agent
    assert [s for s in scripts if "runtime_env/agent/main.py" in s], scripts  # runtime envs need this one
    assert not [s for s in scripts if "autoscaler/_private/monitor.py" in s or "dashboard/dashboard.py" in s]
    for name in ("start_monitor", "start_api_server", "start_log_monitor"):  # Ray's own, back after the start
        assert getattr(node.Node, name).__name__ == name
    assert services.start_ray_process.__name__ == "start_ray_process"
    from ray._private import utils as ray_utils

    assert ray_utils.get_dashboard_dependency_error.__name__ == "get_dashboard_dependency_error"
    env = {"env_vars": {"MILES_PROBE": "1"}}  # a runtime env still reaches workers (the runtime-env agent)
    probe = local_ray.remote(num_cpus=0, runtime_env=env)(lambda: os.environ.get("MILES_PROBE"))
    assert local_ray.get(probe.remote(), timeout=60) == "1"
    # a worker's output still reaches the driver (the log monitor's thread publishes it, Ray's prints it)
    assert "miles-ray-log-monitor" in [t.name for t in threading.enumerate()]
    local_ray.get(local_ray.remote(num_cpus=0)(lambda: print("miles-probe-line", flush=True)).remote())
    seen = ""
    for _ in range(100):
        seen += capsys.readouterr().out
        if "miles-probe-line" in seen:
            break
        time.sleep(0.1)
    assert "miles-probe-line" in seen


def _group(ray, timeout: float):
    from miles.ray.train_group import RayTrainGroup
    from tests.e2e.faults import StuckTrainWorker

    group = object.__new__(RayTrainGroup)  # the fan-out and its error handling, without placement or backend
    group.timeout, group.num_workers, group.cp_size = timeout, 2, 1
    group.workers = [ray.remote(num_cpus=0)(StuckTrainWorker).remote(rank) for rank in range(2)]
    return group


def test_a_hung_or_dead_rank_in_save_is_named(local_ray):
    from miles.ray.utils import PhaseTimeoutError

    hung = _group(local_ray, timeout=3)
    with pytest.raises(PhaseTimeoutError, match=r"phase 'save checkpoint 3'.*training ranks not done: \[1\]"):
        hung.save(3, {})
    hung.shutdown()
    with pytest.raises(RuntimeError, match=r"training worker rank 1 died in phase 'save checkpoint 4'"):
        _group(local_ray, timeout=60).save(4, {})


def test_a_hung_rank_leaves_every_process_stacks_in_the_hang_folder(local_ray, tmp_path):
    import glob

    from miles.ray.train_group import RayTrainGroup
    from miles.ray.utils import PhaseTimeoutError
    from miles.utils import hang_dump
    from tests.e2e.faults import HangingTrainWorker

    stacks = hang_dump.stacks_dir_of(str(tmp_path))
    hang_dump.install(stacks, "driver", driver=True)  # this process is the driver
    group = object.__new__(RayTrainGroup)
    group.timeout, group.num_workers, group.cp_size = 5, 2, 1
    remote = local_ray.remote(num_cpus=0)(HangingTrainWorker)
    group.workers = [remote.remote(rank, stacks) for rank in range(2)]
    try:
        with pytest.raises(PhaseTimeoutError, match=r"training ranks not done: \[1\]") as info:
            group._all("actor train rollout 0", "train", 0, [])
    finally:
        hang_dump.uninstall()
        group.shutdown(grace_s=0)
    folders = glob.glob(str(tmp_path / "logs" / "hang-*"))
    assert len(folders) == 1 and folders[0] in str(info.value), (folders, str(info.value))

    def stacks_of(role: str) -> str:
        (path,) = glob.glob(os.path.join(folders[0], f"{role}-pid*.txt"))
        with open(path) as f:
            return f.read()

    assert "stuck_in_train_step" in stacks_of("trainer-actor-rank1")
    assert "stuck_in_train_step" not in stacks_of(
        "trainer-actor-rank0"
    )  # idle in Ray's task loop: dumped too
    assert "test_a_hung_rank_leaves_every_process_stacks" in stacks_of("driver")
