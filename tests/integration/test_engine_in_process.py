"""The embedded engine served from threads of this process (`InProcessEngine`, how a CPU training rank hosts its
colocated engine): the same HTTP API and the same tokens as the engine's own process, memory release/resume, a
clean shutdown, and the host's torch thread count and random state left as they were."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import torch

from miles.engines.local.in_process import InProcessEngine
from miles.engines.sglang_engine import EngineProcess
from miles.tools.tiny_model import build_word_model

ARGS = {"num-threads": 1, "random-seed": 7, "max-running-requests": 8}
REQUEST = {
    "input_ids": [[3, 4, 5], [6, 7]],
    "rid": ["a", "b"],  # the engine seeds a request's sampler from (--random-seed, rid)
    "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
    "return_logprob": True,
}


def _tokens(url: str) -> list[tuple[list[int], list[float]]]:
    body = httpx.post(url + "/generate", json=REQUEST, timeout=60).json()
    return [(b["output_ids"], [lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]) for b in body]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_word_model(tmp_path_factory.mktemp("tiny")))


def test_same_api_and_tokens_as_its_own_process_and_the_host_keeps_its_threads_and_rng(model_dir, tmp_path):
    torch.set_num_threads(2)
    torch.manual_seed(11)
    rng_before = torch.get_rng_state()
    log = tmp_path / "engine_0.log"
    eng = InProcessEngine(model_dir, local_args=ARGS, admin_api_key="k", log_path=str(log)).launch()
    try:
        assert torch.get_num_threads() == 2  # the engine's 1 thread is its own
        assert torch.equal(torch.get_rng_state(), rng_before)  # building it drew nothing from ours
        seen = {}
        t = threading.Thread(target=lambda: seen.setdefault("n", torch.get_num_threads()))
        t.start(), t.join()
        assert seen["n"] == 2  # threads started later get the host's default, not the engine's
        torch.set_num_threads(2)  # the host sets its count again later (FSDP's set_cpu_threads does)
        assert eng.engine is not None
        assert eng.engine.scheduler.call(torch.get_num_threads).result(30) == 1  # the engine keeps its own
        assert not eng.engine.config.trim_after_release  # a trim would return the rank's freed memory too
        got = _tokens(eng.url)
        with EngineProcess(model_dir, kind="local", local_args=ARGS) as proc:
            assert got == _tokens(proc.url)  # bitwise: same tokens, same log-probs
        # memory release/resume through the admin key, as the driver does it
        headers = {"Authorization": "Bearer k"}
        tags = {"tags": ["weights", "kv_cache"]}
        assert httpx.post(eng.url + "/release_memory_occupation", json=tags).status_code == 401
        r = httpx.post(eng.url + "/release_memory_occupation", json=tags, headers=headers, timeout=60)
        assert r.status_code == 200
        assert httpx.post(eng.url + "/generate", json=REQUEST, timeout=60).status_code == 503
        r = httpx.post(eng.url + "/resume_memory_occupation", json=tags, headers=headers, timeout=60)
        assert r.status_code == 200
        # the rank serving it releases it directly (no HTTP), as over the endpoint
        eng.release_memory(["kv_cache"], 60)
        assert eng.engine.released_tags == {"kv_cache"} and eng.engine.kv_released
        r = httpx.post(
            eng.url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, headers=headers, timeout=60
        )
        assert r.status_code == 200 and not eng.engine.released_tags
        assert "embedded engine serving" in log.read_text()
    finally:
        eng.shutdown()
    port = int(eng.url.rsplit(":", 1)[1])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # the server is gone
    assert torch.get_num_threads() == 2


def test_a_failed_start_leaves_no_server(tmp_path):
    eng = InProcessEngine(str(tmp_path / "no-such-model"), local_args=ARGS)
    with pytest.raises(OSError):
        eng.launch()
    assert eng.engine is None and eng._thread is None
