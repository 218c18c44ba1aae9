"""`miles.ray.utils._lean_head`'s hooks, without starting Ray: the raylet's dashboard agent command is rewritten to
the stand-in agent and nothing else is; Ray's log monitor runs on a driver thread only when Ray's class has the
steps the thread calls (else the head starts its own log monitor process, as before)."""

from __future__ import annotations

import os

import pytest

from miles.ray import utils


def _raylet_command(agent: str) -> list[str]:
    return ["/ray/raylet", "--node_id=abc", f"--dashboard_agent_command=/bin/python3 -u {agent} --node-id=abc",
            "--runtime_env_agent_command=/bin/python3 -u /ray/_private/runtime_env/agent/main.py"]  # fmt: skip


def test_only_the_raylets_dashboard_agent_becomes_the_stub():
    import ray

    agent = os.path.join(os.path.dirname(ray.__file__), "dashboard", "agent.py")
    stub = os.path.join(os.path.dirname(utils.__file__), "agent_stub.py")
    started: list = []
    start = utils._with_agent_stub(lambda cmd, kind, *a, **k: started.append((cmd, kind, a, k)))
    start(_raylet_command(agent), "raylet", fate_share=True)
    cmd, kind, _, kwargs = started[-1]
    assert cmd[2] == f"--dashboard_agent_command=/bin/python3 -u -S {stub} --node-id=abc"
    assert cmd[:2] + cmd[3:] == _raylet_command(agent)[:2] + _raylet_command(agent)[3:]
    assert kind == "raylet" and kwargs == {"fate_share": True}
    other = ["/bin/python3", "-u", agent]  # not the raylet: as it is
    start(other, "dashboard_agent")
    assert started[-1][0] == other
    unknown = _raylet_command("/elsewhere/agent.py")  # a Ray whose agent lives elsewhere: as it is
    start(unknown, "raylet")
    assert started[-1][0] == unknown


def test_the_log_monitor_stays_a_process_when_rays_class_lacks_a_step(monkeypatch):
    from ray._private import log_monitor

    assert utils._log_monitor_class() is log_monitor.LogMonitor
    monkeypatch.delattr(log_monitor.LogMonitor, "open_closed_files")
    assert utils._log_monitor_class() is None
    with utils._lean_head() as skipped:
        assert "start_log_monitor" not in skipped and "start_monitor" in skipped


def test_the_lean_head_puts_rays_methods_back(monkeypatch):
    from ray._private import node, services

    before = (node.Node.start_log_monitor, services.start_ray_process)
    with pytest.raises(RuntimeError), utils._lean_head() as skipped:
        assert "start_log_monitor" in skipped
        assert services.start_ray_process is not before[1]
        raise RuntimeError("ray.init failed")
    assert (node.Node.start_log_monitor, services.start_ray_process) == before


def test_without_runtime_envs_the_raylets_runtime_env_agent_becomes_its_stub_too():
    import ray

    agent = os.path.join(os.path.dirname(ray.__file__), "dashboard", "agent.py")
    env_agent = os.path.join(os.path.dirname(ray.__file__), "_private", "runtime_env", "agent", "main.py")
    here = os.path.dirname(utils.__file__)
    command = ["/ray/raylet", f"--dashboard_agent_command=/bin/python3 -u {agent} --node-id=abc",
               f"--runtime_env_agent_command=/bin/python3 -u {env_agent} --node-id=abc"]  # fmt: skip
    started: list = []
    start = utils._with_agent_stub(lambda cmd, kind, *a, **k: started.append(cmd), runtime_env_agent=False)
    start(command, "raylet")
    assert started[-1] == [
        "/ray/raylet",
        f"--dashboard_agent_command=/bin/python3 -u -S {here}/agent_stub.py --node-id=abc",
        f"--runtime_env_agent_command=/bin/python3 -u -S {here}/runtime_env_stub.py --node-id=abc",
    ]
    utils._with_agent_stub(lambda cmd, kind, *a, **k: started.append(cmd))(command, "raylet")  # the default
    assert started[-1][2] == command[2]  # Ray's runtime-env agent stays


@pytest.mark.parametrize(
    ("runtime_envs", "env_vars", "environ", "agent"),
    [
        (False, None, {}, False),  # the only case without Ray's runtime-env agent
        (True, None, {}, True),
        (False, {"A": "1"}, {}, True),  # the job's own runtime env
        (False, None, {"RAY_RUNTIME_ENV_HOOK": "my.hook"}, True),  # Ray would give the job one
        (False, None, {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}, True),  # a `ray job submit` job
    ],
)
def test_a_local_head_keeps_rays_runtime_env_agent_unless_the_run_asks_for_no_runtime_env(
    monkeypatch, runtime_envs, env_vars, environ, agent
):
    import contextlib

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in ("RAY_RUNTIME_ENV_HOOK", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    heads: list = []

    @contextlib.contextmanager
    def lean_head(runtime_env_agent: bool = True):
        heads.append(runtime_env_agent)
        yield []

    monkeypatch.setattr(utils, "_lean_head", lean_head)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    assert utils.init_ray(min_cpus=1, env_vars=env_vars, runtime_envs=runtime_envs)
    assert heads == [agent]
