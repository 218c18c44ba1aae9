"""Engine keys never go on a command line (/proc/<pid>/cmdline is world-readable), and each run has one."""

from __future__ import annotations

import shlex

from miles.config import parse_config
from miles.engines.local.__main__ import parse_args
from miles.engines.sglang_engine import EngineProcess
from miles.engines.sglang_launch import ADMIN_API_KEY_ENV, API_KEY_ENV, argv_with_keys

MINIMAL = (
    "--hf-checkpoint /m --prompt-data /d.jsonl --num-rollout 2 --rollout-batch-size 4 "
    "--n-samples-per-prompt 2 --global-batch-size 8 --colocate"
)


def test_keys_go_by_environment_not_on_the_command_line(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "stale")  # inherited from the parent: dropped, the engine has no api key
    for kind in ("local", "sglang"):
        proc = EngineProcess("/m", kind=kind, port=1234, admin_api_key="s3cret")
        cmd = proc.command()
        assert not any("s3cret" in a or "api-key" in a for a in cmd), cmd
        env = proc.launch_env()
        assert env[ADMIN_API_KEY_ENV] == "s3cret" and API_KEY_ENV not in env
    assert "miles.engines.sglang_launch" in EngineProcess("/m", kind="sglang", port=1).command()


def test_sglang_launcher_moves_keys_onto_its_argv():
    env = {API_KEY_ENV: "a", ADMIN_API_KEY_ENV: "b"}
    assert argv_with_keys(["--port=1"], env) == ["--port=1", "--api-key=a", "--admin-api-key=b"]
    assert argv_with_keys(["--api-key", "x"], env) == ["--api-key", "x", "--admin-api-key=b"]
    assert argv_with_keys(["--api-key=x"], env) == ["--api-key=x", "--admin-api-key=b"]
    assert argv_with_keys(["--port=1"], {}) == ["--port=1"]


def test_embedded_engine_reads_keys_from_environment(monkeypatch):
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "s3cret")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse_args(["--model-path", "/m"])
    assert (args.admin_api_key, args.api_key) == ("s3cret", None)
    # a key from the environment protects a public bind like one from the command line
    assert parse_args(["--model-path", "/m", "--host", "0.0.0.0"]).admin_api_key == "s3cret"


def test_each_run_gets_its_own_engine_key():
    from miles.ray.setup import with_run_engine_key

    cfg = parse_config(shlex.split(MINIMAL))
    assert cfg.engine.engine_api_key is None
    a, b = with_run_engine_key(cfg), with_run_engine_key(cfg)
    assert a.engine.engine_api_key and b.engine.engine_api_key
    assert a.engine.engine_api_key != b.engine.engine_api_key and len(a.engine.engine_api_key) >= 32
    assert "<redacted>" in a.to_yaml() and a.engine.engine_api_key not in a.to_yaml()
    user = parse_config(shlex.split(MINIMAL + " --engine-api-key mine"))
    assert with_run_engine_key(user).engine.engine_api_key == "mine"
