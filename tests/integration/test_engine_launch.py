"""Engine launcher (kind resolution, command lines, startup errors, API key) and sglang-router passthrough."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import httpx
import pytest

from miles.engines import sglang_engine
from miles.engines.local.__main__ import parse_args
from miles.engines.local.testing import build_tiny_model
from miles.engines.router import Router
from miles.engines.sglang_engine import EngineProcess, EngineStartupError, resolve_engine_kind

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_resolve_engine_kind(monkeypatch):
    import torch

    real_find_spec = importlib.util.find_spec

    def fake_find_spec(present):
        return lambda name, *a: (
            (object() if present else None) if name == "sglang" else real_find_spec(name, *a)
        )

    monkeypatch.setattr(sglang_engine.importlib.util, "find_spec", fake_find_spec(False))
    assert resolve_engine_kind("auto") == "local"
    assert resolve_engine_kind("local") == "local"
    with pytest.raises(ValueError, match=r"pip install 'miles\[gpu\]'"):
        resolve_engine_kind("sglang")
    with pytest.raises(ValueError, match="allowed"):
        resolve_engine_kind("vllm")
    monkeypatch.setattr(sglang_engine.importlib.util, "find_spec", fake_find_spec(True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_engine_kind("auto") == "sglang"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_engine_kind("auto") == "local"
    assert resolve_engine_kind("sglang") == "sglang"


def test_command_lines():
    eng = EngineProcess(
        "/m",
        kind="sglang",
        port=1234,
        tp_size=2,
        sglang_args={"mem_fraction_static": "0.7", "enable-memory-saver": True, "skip": False},
    )
    cmd = eng.command()
    assert cmd[1:3] == [
        "-m",
        "miles.engines.sglang_launch",
    ]  # sglang.launch_server, keys from the environment
    assert cmd[3:] == [
        "--model-path", "/m", "--host", "127.0.0.1", "--port", "1234", "--tp-size", "2",
        "--mem-fraction-static", "0.7", "--enable-memory-saver",
    ]  # fmt: skip
    local = EngineProcess("/m", kind="local", port=5, api_key="k", local_args={"random_seed": 3}).command()
    assert local[1:3] == ["-m", "miles.engines.local"] and local[-2:] == ["--random-seed", "3"]
    assert "k" not in local and "--api-key" not in local  # the key goes by environment
    wildcard = EngineProcess("/m", kind="local", host="0.0.0.0", port=7, api_key="k")
    assert wildcard.url == f"http://{sglang_engine.node_ip()}:7" and "0.0.0.0" not in wildcard.url
    with pytest.raises(ValueError, match="tp_size"):
        EngineProcess("/m", kind="local", tp_size=2)
    with pytest.raises(ValueError, match="resolve 'auto'"):
        EngineProcess("/m", kind="auto")


def test_import_does_not_pull_ray_or_sglang():
    code = "import sys, miles.engines.sglang_engine, miles.engines.router; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_non_loopback_needs_api_key(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "/m", "--host", "0.0.0.0"])
    assert "--admin-api-key (or --api-key) is required" in capsys.readouterr().err
    assert parse_args(["--model-path", "/m", "--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"


def test_startup_failure_reports_phase_and_log(tmp_path):
    eng = EngineProcess(str(tmp_path / "no-such-model"), kind="local", startup_timeout=120)
    with pytest.raises(EngineStartupError) as e:
        eng.launch()
    msg = str(e.value)
    assert "exited with code" in msg and "waiting for" in msg and "no-such-model" in msg  # log tail included
    eng.shutdown()


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    with EngineProcess(str(path), kind="local", admin_api_key="s3cret", local_args={"num-threads": 1}) as eng:
        yield eng


def test_admin_api_key_guards_admin_endpoints_only(keyed_engine):
    plain = httpx.Client(trust_env=False)
    assert plain.post(keyed_engine.url + "/flush_cache").status_code == 401
    bad = plain.post(keyed_engine.url + "/flush_cache", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json() == {"error": "Unauthorized"}  # SGLang's answer
    assert keyed_engine.post("/flush_cache")["success"]  # EngineProcess sends the admin key
    assert plain.get(keyed_engine.url + "/health").status_code == 200
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}
    assert plain.post(keyed_engine.url + "/generate", json=body, timeout=60).status_code == 200


def test_startup_deadline(keyed_engine):
    eng = EngineProcess(keyed_engine.model_path, kind="local", startup_timeout=0.5)
    try:
        with pytest.raises(EngineStartupError, match=r"not healthy after .*phase: waiting for /health"):
            eng.launch()
        assert eng.proc is None  # the half-started server was shut down
    finally:
        eng.shutdown()


def test_router_passthrough(keyed_engine):
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    direct = keyed_engine.post("/generate", body)
    with Router([]) as router:
        assert router.list_workers() == []
        router.add_worker(keyed_engine.url)
        assert router.list_workers() == [keyed_engine.url]
        resp = httpx.post(router.url + "/generate", json=body, timeout=60, trust_env=False)
        assert resp.status_code == 200, resp.text
        assert resp.json()["output_ids"] == direct["output_ids"]
        assert resp.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        router.remove_worker(keyed_engine.url)
        assert router.list_workers() == []


def test_ray_actor_class_is_built_lazily():
    cls = sglang_engine.make_engine_actor_class()
    assert cls is sglang_engine.make_engine_actor_class()  # built once
    assert hasattr(cls, "remote") and hasattr(cls, "options")
    for method in ("launch", "url", "post", "get", "shutdown"):
        assert hasattr(cls, method)
