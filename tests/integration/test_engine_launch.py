"""Engine launcher (kind resolution, command lines, startup errors, API key) and sglang-router passthrough."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import httpx
import pytest

from miles.engines import sglang_engine
from miles.engines.local.__main__ import parse_args
from miles.engines.router import Router
from miles.engines.sglang_engine import EngineProcess, EngineStartupError, resolve_engine_kind
from miles.tools.tiny_model import build_word_model
from miles.utils import net


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
    # the placement's answer wins over torch's (the engine fleet's process never imports torch)
    assert resolve_engine_kind("auto", gpu=True) == "sglang"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_engine_kind("auto", gpu=False) == "local"


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
        "--model-path=/m",
        "--host=127.0.0.1",
        "--port=1234",
        "--tp-size=2",
        "--mem-fraction-static=0.7",
        "--enable-memory-saver",
    ]  # fmt: skip  (one token per valued flag: a value starting with '-' stays a value)
    local = EngineProcess("/m", kind="local", port=5, api_key="k", local_args={"random_seed": 3}).command()
    assert local[1:3] == ["-m", "miles.engines.local"] and local[-1] == "--random-seed=3"
    assert "k" not in local and "--api-key" not in local  # the key goes by environment
    wildcard = EngineProcess("/m", kind="local", host="0.0.0.0", port=7, api_key="k")
    assert wildcard.url == f"http://{net.node_ip()}:7" and "0.0.0.0" not in wildcard.url
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
    path = build_word_model(tmp_path_factory.mktemp("tiny"))
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
        with pytest.raises(EngineStartupError, match=r"not ready after .*phase: waiting for /health"):
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


def test_generate_client_sends_only_to_engines_the_router_lists(keyed_engine, monkeypatch):
    """The generate client bypasses sglang-router for generation but reads its worker list (the fault-tolerance
    registry): an engine the router does not list gets nothing (here a dead URL, never tried), a request waits
    while no engine is listed and goes out once the router lists one again."""
    import asyncio
    import threading
    import time

    import miles.rollout.generate_client as ec
    from miles.utils.net import free_port

    monkeypatch.setattr(ec, "ENGINE_LIST_TTL_S", 0.0)
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with Router([keyed_engine.url]) as router:

        async def go() -> list[int]:
            async with ec.GenerateClient(router.url, [dead, keyed_engine.url], None, 60.0, 4) as c:
                sent = []
                for i in range(3):
                    out = await c.generate([3, 4], {"max_new_tokens": 2, "ignore_eos": True}, i, "test")
                    sent.append(len(out.output_ids))
                assert c.requests_sent == 3  # none went to the dead engine
                router.remove_worker(keyed_engine.url)  # what the health monitor does before a restart
                readmitted: list[float] = []

                def readmit() -> None:  # after the refit
                    readmitted.append(time.monotonic())
                    router.add_worker(keyed_engine.url)

                timer = threading.Timer(1.0, readmit)
                timer.start()
                out = await c.generate([3, 4], {"max_new_tokens": 2, "ignore_eos": True}, 3, "test")
                answered = time.monotonic()
                timer.join()
                assert readmitted and answered > readmitted[0]  # it waited for the router to list the engine
                return sent + [len(out.output_ids)]

        assert asyncio.run(go()) == [2, 2, 2, 2]


def test_batch_generate_equals_single_requests(keyed_engine):
    """SGLang's batch form (what the rollout's generate client sends for a prompt group: per-item sampling params
    and rids) answers a list in the batch's order, each item what the same request alone answers (sampling is
    seeded by the rid). sglang-router refuses this form (422: it takes one rid and one sampling_params), so
    with several engines the client sends batches to the engines itself."""
    lengths = (3, 2, 4)
    body = {
        "input_ids": [[3, 4, 5], [6, 7], [3, 4, 5]],
        "sampling_params": [{"max_new_tokens": n, "temperature": 1.0} for n in lengths],
        "rid": ["b-0", "b-1", "b-2"],
        "return_logprob": True,
    }
    batch = keyed_engine.post("/generate", body)
    assert isinstance(batch, list) and len(batch) == 3
    for i, answer in enumerate(batch):
        alone = keyed_engine.post(
            "/generate",
            {"input_ids": body["input_ids"][i], "sampling_params": body["sampling_params"][i],
             "rid": f"b-{i}", "return_logprob": True},
        )  # fmt: skip
        assert answer["output_ids"] == alone["output_ids"] and len(answer["output_ids"]) <= lengths[i]
        lps = [e[0] for e in answer["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx([e[0] for e in alone["meta_info"]["output_token_logprobs"]], abs=1e-5)
    # a per-request sampling_seed (what the rollout sends) survives batching and outranks the rid: a request
    # alone under another rid draws what the same seed drew inside the batch
    n, seeds = 6, [11, 12, 11]
    seeded = {**body, "sampling_params": [{"max_new_tokens": n, "temperature": 1.0, "sampling_seed": s}
                                          for s in seeds]}  # fmt: skip
    batch = keyed_engine.post("/generate", seeded)
    assert batch[0]["output_ids"] == batch[2]["output_ids"]  # same prompt, same seed, different rids
    for i in range(3):
        alone = keyed_engine.post(
            "/generate",
            {"input_ids": body["input_ids"][i], "sampling_params": seeded["sampling_params"][i],
             "rid": f"alone-{i}", "return_logprob": True},
        )  # fmt: skip
        assert batch[i]["output_ids"] == alone["output_ids"], i


def test_ray_actor_class_is_built_lazily():
    cls = sglang_engine.make_engine_actor_class()
    assert cls is sglang_engine.make_engine_actor_class()  # built once
    assert hasattr(cls, "remote") and hasattr(cls, "options")
    for method in ("launch", "url", "post", "get", "shutdown"):
        assert hasattr(cls, method)
