"""miles's client code against SGLang 0.5.23's own server code, and the embedded engine against the same contract.

The SGLang server is SGLang's real HTTP front-end (FastAPI `app`, `TokenizerManager`, API-key middleware,
`ServerArgs` parsing of miles's launch command line) with a stand-in scheduler that routes control requests into
SGLang's real weight-update and memory bookkeeping (tests/sglang_conformance). It needs `.venv-sglang`, made by
`bash scripts/sglang-venv.sh`; without it these tests skip (fail under CI=true: tests/conftest.py). One SGLang
server serves the whole module (start-up costs ~40 s), so the test that kills it runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from miles.engines.sglang_engine import EngineProcess, engine_launch_kwargs
from miles.utils.engine_control_http import bearer, launch_keys
from tests.integration._util import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[2]
HARNESS_PYTHON = ROOT / "tests" / "sglang_conformance" / "python"
VENV = Path(os.environ.get("MILES_SGLANG_VENV", ROOT / ".venv-sglang"))
KEY = "conformance-run-key"
SEED, INDEX = 42, 1

pytestmark = pytest.mark.side_venv(VENV, ".miles-sglang-ok", "bash scripts/sglang-venv.sh")


def _launch(kind: str, model_dir: str) -> EngineProcess:
    launch = engine_launch_kwargs(kind, INDEX, SEED, colocate=True, local_args={"num-threads": 1})
    return EngineProcess(
        model_dir, kind=kind, startup_timeout=300, **launch_keys(KEY),
        python=str(HARNESS_PYTHON) if kind == "sglang" else None, **launch,
    ).launch()  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from miles.tools.tiny_model import build_word_model

    return str(build_word_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="module")
def sglang(model_dir):
    eng = _launch("sglang", model_dir)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def local(model_dir):
    eng = _launch("local", model_dir)
    yield eng
    eng.shutdown()


@pytest.fixture(params=["sglang", "local"])
def engine(request):
    return request.getfixturevalue(request.param)


def _admin() -> dict[str, str]:
    return bearer(KEY)


def _post(engine: EngineProcess, path: str, body: dict, key: bool = True) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, headers=_admin() if key else {}, timeout=120)


# ------------------------------------------------------------------------------------ launch command line


# miles's command line, parsed by SGLang's ServerArgs; one test per launch defect, so none masks another.


def test_launch_seed_reaches_sglang(sglang):
    """random_seed = rollout_seed + engine index (SGLang draws a random seed per launch otherwise)."""
    assert sglang.get("/server_info")["random_seed"] == SEED + INDEX


def test_launch_memory_saver_reaches_sglang(sglang):
    """Colocated: --enable-memory-saver, and the cuda_graph region (SGLANG_MEMORY_SAVER_CUDA_GRAPH=true)."""
    info = sglang.get("/server_info")
    assert info["enable_memory_saver"] is True
    saver = info["internal_states"][0]["memory_saver"]
    assert saver["enabled"] and "cuda_graph" in saver["regions"]


def test_launch_key_guards_every_endpoint(sglang):
    """The run's key (--engine-api-key, or one drawn per run) becomes both SGLang's --api-key and --admin-api-key:
    with the admin key alone, SGLang's keyless GET /server_info answered the admin key in clear."""
    info = sglang.get("/server_info")
    assert info["admin_api_key"] == info["api_key"] == KEY


def _routes(kind: str) -> list[tuple[str, str]]:
    """(method, path) of every route the engine's app serves (path parameters filled with 'x')."""
    from tests.sglang_conformance.routes import app_routes

    if kind == "local":
        from miles.engines.local.server import create_app

        return app_routes(create_app(None).routes)  # type: ignore[arg-type]
    script = ROOT / "tests" / "sglang_conformance" / "routes.py"
    out = subprocess.run([str(HARNESS_PYTHON), str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [(m, p) for m, p in json.loads(out.stdout.strip().splitlines()[-1])]


def test_no_key_is_readable_without_a_key(engine):
    """Every route of the engine's app, asked without a key: only /health*, /ready* and /metrics* answer (the
    router's probes), and no answer carries the key."""
    routes = _routes(engine.kind)
    assert ("GET", "/server_info") in routes and ("POST", "/generate") in routes, routes
    plain = httpx.Client(trust_env=False, timeout=120)
    opened = []
    for method, path in routes:
        resp = plain.request(method, engine.url + path, json={} if method == "POST" else None)
        assert KEY not in resp.text, (method, path, resp.text[:500])
        if resp.status_code != 401:
            opened.append(path)
    assert all(p.startswith(("/health", "/ready", "/metrics")) for p in opened), opened
    assert plain.get(engine.url + "/health").status_code == 200


# ------------------------------------------------------------------------------------ contract, both engines


def test_api_key_levels(engine):
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for path, payload in (("/generate", body), ("/flush_cache", {})):
        refused = _post(engine, path, payload, key=False)
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        assert _post(engine, path, payload).status_code == 200


def test_refit_outside_session_refused(engine):
    from miles.utils.serialization import serialize, share_named_tensors

    payload = serialize(share_named_tensors([("model.norm.weight", torch.ones(32))]))
    resp = _post(engine, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert resp.status_code == 400
    assert resp.json() == {
        "success": False,
        "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
    }
    assert _post(engine, "/begin_weight_update", {}).json()["success"]
    again = _post(engine, "/begin_weight_update", {})
    assert again.status_code == 400 and "already open" in again.json()["message"]
    assert _post(engine, "/end_weight_update", {}).json()["success"]
    extra = _post(engine, "/end_weight_update", {})
    assert extra.status_code == 400 and "no weight-update session is open" in extra.json()["message"]


def test_pause_and_continue_request_shapes(engine):
    """/pause_generation takes SGLang's `mode` (abort, retract, in_place) and answers its {message, status} body,
    as does /continue_generation (with `torch_empty_cache` too); generation goes on after."""
    from miles.utils import engine_control_http as eh

    for mode in eh.PAUSE_MODES:
        paused = _post(engine, "/pause_generation", {"mode": mode})
        assert paused.status_code == 200, (mode, paused.text)
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        resumed = _post(engine, "/continue_generation", {"torch_empty_cache": False})
        assert resumed.status_code == 200, (mode, resumed.text)
        assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
    eh.pause_generation([engine.url], "retract", _admin(), 60)  # the client's helpers against the same server
    eh.continue_generation([engine.url], _admin(), 60)
    if engine.kind == "local":  # SGLang's scheduler asserts the mode (a bad one could kill the shared server)
        assert _post(engine, "/pause_generation", {"mode": "freeze"}).status_code == 400
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert _post(engine, "/generate", body).status_code == 200


def test_context_errors_match(sglang, local):
    too_long = {"input_ids": [5] * 600, "sampling_params": {"max_new_tokens": 1}}
    too_many = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 600}}
    for body in (too_long, too_many):
        a, b = _post(sglang, "/generate", body), _post(local, "/generate", body)
        assert a.status_code == b.status_code == 400
        assert b.json()["error"]["message"] in str(a.json()), (a.json(), b.json())


# ------------------------------------------------------------------------------------ miles's client code


def test_rollout_generate_through_router(sglang):
    """The rollout's generate client and the stock single-turn generate function through sglang-router, and its
    abort (POST /abort_request {"abort_all": true} with the admin key) on SGLang's own front-end."""
    from miles.engines.router import Router
    from miles.rollout.base_types import GenerateContext, SamplingSettings
    from miles.rollout.generate import generate_single_turn
    from miles.rollout.generate_client import GenerateClient
    from miles.utils.types import Sample

    samples = [Sample(index=i, group_index=i, prompt="", tokens=[3 + i, 4, 5]) for i in range(3)]
    settings = SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4)
    ctx = GenerateContext(tokenizer=None, request_id_prefix="conformance")

    async def run(router_url: str) -> None:
        async with GenerateClient(router_url, [sglang.url], KEY, timeout=120, concurrency=3) as client:
            await asyncio.gather(*(generate_single_turn(client, s, settings, ctx) for s in samples))
            await client.abort_all("conformance abort")

    with Router([sglang.url], worker_api_key=KEY) as router:
        assert KEY not in httpx.get(router.url + "/workers").text  # the router's API shows no worker key
        asyncio.run(run(router.url))
    for s in samples:
        assert s.response_length >= 1 and len(s.rollout_log_probs) == s.response_length
        assert s.loss_mask == [1] * s.response_length and s.check_consistent() is None
        assert s.weight_versions == ["default"]


def test_an_engine_retracting_every_time_ends_the_request_at_its_deadline(sglang):
    """SGLang's decode retraction without a KV backup answers 503 "... Retry later" while /health answers 200
    (after its 1 s one-token check): the request ends at its deadline, naming the engine and SGLang's answer."""
    from miles.rollout.generate_client import EngineError, GenerateClient
    from tests.sglang_conformance.fake_scheduler import RETRACTED_PROMPT

    async def run() -> None:
        async with GenerateClient(sglang.url, [sglang.url], KEY, timeout=3, concurrency=1) as client:
            await asyncio.wait_for(
                client.generate(RETRACTED_PROMPT, {"max_new_tokens": 2}, 0, "conformance"), 60
            )

    with pytest.raises(EngineError) as info:
        asyncio.run(run())
    msg = str(info.value)
    assert f"{sglang.url}/generate answered 503" in msg and "Retracted under decode memory pressure" in msg, (
        msg
    )
    attempts = int(re.search(r"gave up after (\d+) attempt", msg).group(1))
    assert 1 <= attempts <= 5, msg


def _tensor_body(rank: int, world: int, url: str, model_dir: str) -> None:
    """ColocatedWeightUpdater alone (no release/resume): its buckets must travel inside a weight-update session."""
    from transformers import AutoModelForCausalLM

    from miles.refit.session import RefitSetup
    from miles.refit.tensor_handles import ColocatedWeightUpdater

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    updater = ColocatedWeightUpdater(
        RefitSetup([url], 1, rank, world, api_key=KEY, timeout_s=60, check_equal=True)
    )
    updater.update(model, bucket_bytes=4096, weight_version="tensor-1")
    assert httpx.get(f"{url}/model_info", headers=_admin()).json()["weight_version"] == "tensor-1"
    name, tensor = next(iter(model.named_parameters()))
    got = httpx.post(
        f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 8}, headers=_admin()
    ).json()
    assert torch.equal(torch.tensor(got, dtype=torch.float32), tensor.detach().flatten()[:8])


def test_tensor_refit_path(sglang, model_dir):
    run_distributed(_tensor_body, 1, sglang.url, model_dir, timeout_s=240)


def _colocated_body(rank: int, world: int, url: str, model_dir: str) -> None:
    """The colocated start-up refit, then one release -> refit -> resume cycle, driven by miles's choreography
    and ColocatedWeightUpdater (with checksums); SGLang's bookkeeping must end with nothing released."""
    from transformers import AutoModelForCausalLM

    from miles.ray.colocate import MemoryChoreography
    from miles.refit.session import RefitSetup
    from miles.refit.tensor_handles import ColocatedWeightUpdater
    from miles.utils.engine_control_http import EngineMemoryControl

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    updater = ColocatedWeightUpdater(
        RefitSetup([url], 1, rank, world, api_key=KEY, timeout_s=60, check_equal=True)
    )

    class Trainer:
        def update_weights(self, urls: list[str], version: str, flush_cache: bool = True) -> None:
            updater.update(model, bucket_bytes=4096, weight_version=version)

        def sleep(self) -> None: ...

        def wake_up(self) -> None: ...

    # miles's own control client: each release flushes until SGLang answers that it is idle, then releases
    choreo = MemoryChoreography(True, Trainer(), EngineMemoryControl([url], KEY, 60), [url])
    choreo.refit("1")  # start-up: the engine released nothing
    state = httpx.get(f"{url}/server_info", headers=_admin()).json()["internal_states"][0]
    assert state["offload_tags"] == [] and state["memory_saver"]["paused"] == [], state
    choreo.before_train()
    state = httpx.get(f"{url}/server_info", headers=_admin()).json()["internal_states"][0]
    assert sorted(state["memory_saver"]["paused"]) == ["cuda_graph", "kv_cache", "weights"], state
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    choreo.refit("2")
    state = httpx.get(f"{url}/server_info", headers=_admin()).json()["internal_states"][0]
    assert state["offload_tags"] == [] and state["memory_saver"]["paused"] == [], state
    assert httpx.get(f"{url}/model_info", headers=_admin()).json()["weight_version"] == "2"
    name, tensor = next(iter(model.named_parameters()))
    got = httpx.post(
        f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 8}, headers=_admin()
    ).json()
    assert torch.equal(torch.tensor(got, dtype=torch.float32), tensor.detach().flatten()[:8])


def test_colocated_startup_and_cycle_tensor_path(sglang, model_dir):
    run_distributed(_colocated_body, 1, sglang.url, model_dir, timeout_s=240)


def _broadcast_body(rank: int, world: int, url: str, model_dir: str, port: int) -> None:
    from transformers import AutoModelForCausalLM

    from miles.refit.broadcast import DistributedWeightUpdater
    from miles.refit.session import RefitSetup

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    setup = RefitSetup([url], 1, rank, world, api_key=KEY, timeout_s=60, check_equal=True)
    updater = DistributedWeightUpdater(setup, "127.0.0.1", port, backend="gloo")
    updater.connect()
    try:
        updater.update(model, bucket_bytes=4096, weight_version="bcast-1")
    finally:
        updater.disconnect()
    assert httpx.get(f"{url}/model_info", headers=_admin()).json()["weight_version"] == "bcast-1"


def test_broadcast_refit_path(engine, model_dir):
    run_distributed(_broadcast_body, 1, engine.url, model_dir, free_port(), timeout_s=240)


# ------------------------------------------------------------------------------------ last: kills SGLang's server


def test_resume_of_unreleased_tag(local, sglang):
    """SGLang's scheduler dies on a resume of a tag it never released; the stand-in refuses with a 400."""
    resp = _post(local, "/resume_memory_occupation", {"tags": ["weights"]})
    assert resp.status_code == 400 and "were not released" in resp.json()["message"]
    with pytest.raises(httpx.HTTPError):
        _post(sglang, "/resume_memory_occupation", {"tags": ["weights"]})
        sglang.proc.wait(30)
        httpx.get(sglang.url + "/health", timeout=5)
