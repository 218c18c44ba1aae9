"""The synchronous engine-control HTTP layer (`miles.utils.engine_control_http`) against a mock transport: keys,
deadlines, success checks and errors that name the server, the endpoint, what the call was for and the phase."""

from __future__ import annotations

import json
import pickle

import httpx
import pytest

from miles.utils import engine_control_http as eh


def _client(handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_bearer_and_sglang_key_rule():
    assert eh.bearer(None) == {} and eh.bearer("") == {}
    assert eh.bearer("k") == {"Authorization": "Bearer k"}
    # admin endpoints take the admin key when one is set, everything else the API key
    assert eh.engine_headers("/flush_cache", "api", "adm") == {"Authorization": "Bearer adm"}
    assert eh.engine_headers("flush_cache", "api", "adm") == {"Authorization": "Bearer adm"}  # slash optional
    assert eh.engine_headers("/generate", "api", "adm") == {"Authorization": "Bearer api"}
    assert eh.engine_headers("/flush_cache", "api", None) == {"Authorization": "Bearer api"}
    assert eh.engine_headers("/generate", None, "adm") == {}


def test_request_sends_body_headers_and_deadline():
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen.update(
            url=str(req.url), auth=req.headers.get("authorization"), body=json.loads(req.content),
            timeout=req.extensions["timeout"]["read"],
        )  # fmt: skip
        return httpx.Response(200, json={"success": True, "x": 1})

    answer = eh.request(
        "POST", "http://e:1", "/update_weights_from_tensor", "refit v1", 7.5, eh.bearer("k"), {"a": 1},
        client=_client(handler),
    ).json(require_success=True)  # fmt: skip
    assert answer == {"success": True, "x": 1}
    assert seen == {
        "url": "http://e:1/update_weights_from_tensor", "auth": "Bearer k", "body": {"a": 1}, "timeout": 7.5
    }  # fmt: skip


@pytest.mark.parametrize(
    ("handler", "error", "phase", "detail"),
    [
        (lambda r: httpx.Response(500, text="boom"), eh.EngineStatusError, "status", "HTTP 500: boom"),
        (lambda r: httpx.Response(200, text="<html>"), eh.EngineCallError, "response", "not JSON"),
        (lambda r: httpx.Response(200, json={"success": False, "message": "no session"}), eh.EngineCallError,
         "response", "success=false: no session"),
        (lambda r: httpx.Response(200, json=[1]), eh.EngineCallError, "response", "success=false: [1]"),
    ],
)  # fmt: skip
def test_errors_name_engine_endpoint_what_and_phase(handler, error, phase, detail):
    with pytest.raises(error) as info:
        eh.request("POST", "http://e:1", "begin_weight_update", "refit v2", 5.0, {}, {},
                   client=_client(handler)).json(require_success=True)  # fmt: skip
    message = str(info.value)
    assert message.startswith(f"engine http://e:1, begin_weight_update, refit v2, phase {phase}: "), message
    assert detail in message
    assert (info.value.url, info.value.endpoint, info.value.phase) == (
        "http://e:1",
        "begin_weight_update",
        phase,
    )


def test_status_error_keeps_status_and_body():
    client = _client(lambda r: httpx.Response(400, text="temperature must be >= 0"))
    with pytest.raises(eh.EngineStatusError, match="temperature") as info:
        eh.request("POST", "http://e:1", "/generate", "", 5.0, client=client)
    assert info.value.status == 400 and info.value.body == "temperature must be >= 0"
    assert str(info.value).startswith(
        "engine http://e:1, generate, phase status: HTTP 400"
    )  # no empty `what`


def test_request_phase_errors_are_timeout_and_connection_errors():
    def slow(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=req)

    def refused(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    with pytest.raises(eh.EngineTimeout, match=r"phase request: ReadTimeout: .*no answer within 2 s") as t:
        eh.request("POST", "http://e:1", "flush_cache", "engine control", 2.0, client=_client(slow))
    assert isinstance(t.value, TimeoutError)
    with pytest.raises(eh.EngineUnreachable, match="phase request: ConnectError: connection refused") as c:
        eh.request("GET", "http://r:2", "workers", "listing", 2.0, client=_client(refused), server="router")
    assert isinstance(c.value, ConnectionError) and str(c.value).startswith(
        "router http://r:2, workers, listing"
    )


def test_empty_answer_is_none_and_get_requires_an_object(monkeypatch):
    empty = _client(lambda r: httpx.Response(200))
    assert eh.request("POST", "http://e:1", "abort_request", "", 1.0, client=empty).json() is None
    monkeypatch.setattr(
        eh, "_CLIENT", _client(lambda r: httpx.Response(200, json=[1, 2]))
    )  # the process's client
    with pytest.raises(eh.EngineCallError, match="model_info, check, phase response: not a JSON object"):
        eh.get_engine_json("http://e:1", "model_info", {}, 1.0, "check")


def test_errors_survive_pickling():
    """Ray ships an actor's errors to the driver by pickle: the class, message and fields must come back."""
    errors = [
        eh.EngineStatusError("http://e:1", "generate", "x", 503, "busy"),
        eh.EngineUnreachable("http://e:1", "flush_cache", "engine control", "request", "refused"),
        eh.EngineCallError("http://r:1", "workers", "", "response", "not JSON", server="router"),
    ]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.phase == error.phase
    assert pickle.loads(pickle.dumps(errors[0])).status == 503


def test_one_client_per_process():
    assert eh.http_client() is eh.http_client()
    assert eh.http_client().trust_env is False  # engines are reached directly, never through a proxy


def test_post_to_engines_posts_to_all_at_once_and_names_a_dead_one(monkeypatch):
    """Every engine gets the POST, concurrently (each handler waits until all have been reached); the first
    failure in URL order is raised, an unreachable engine named as ending the run."""
    import threading

    urls = ["http://e0:1", "http://e1:1", "http://e2:1"]
    all_in = threading.Barrier(len(urls), timeout=5)
    seen: list[tuple[str, object, str | None]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        all_in.wait()  # breaks (an error) unless the three requests are in flight together
        seen.append((req.url.host, json.loads(req.content), req.headers.get("authorization")))
        return httpx.Response(200)

    monkeypatch.setattr(eh, "_CLIENT", _client(handler))
    eh.post_to_engines(urls, "/release_memory_occupation", {"tags": ["kv_cache"]}, eh.bearer("k"), 2.0, "x")
    assert sorted(seen) == [(f"e{i}", {"tags": ["kv_cache"]}, "Bearer k") for i in range(3)]

    def e1_dead(req: httpx.Request) -> httpx.Response:
        if req.url.host == "e1":
            raise httpx.ConnectError("connection refused", request=req)
        return httpx.Response(500 if req.url.host == "e2" else 200, text="boom")

    monkeypatch.setattr(eh, "_CLIENT", _client(e1_dead))
    with pytest.raises(eh.EngineUnreachable, match=r"engine http://e1:1, flush_cache, .*ends the run unless"):
        eh.post_to_engines(urls, "flush_cache", {}, {}, 2.0, "engine control")
    with pytest.raises(eh.EngineStatusError, match="engine http://e2:1"):
        eh.post_to_engines(urls[::2], "flush_cache", {}, {}, 2.0, "engine control")


def test_a_release_flushes_until_the_engine_is_idle_then_releases(monkeypatch):
    """SGLang answers /flush_cache 400 while requests run; the release is sent only after a flush succeeded, on
    every engine (each at its own pace)."""
    seen: list[tuple[str, str]] = []
    busy = {"e0": 2, "e1": 0}  # 400 answers before the engine is idle

    def handler(req: httpx.Request) -> httpx.Response:
        host, path = req.url.host, req.url.path
        seen.append((host, path))
        if path == "/flush_cache" and busy[host] > 0:
            busy[host] -= 1
            return httpx.Response(400, text="Flush cache failed.\n")
        return httpx.Response(200)

    monkeypatch.setattr(eh, "_CLIENT", _client(handler))
    monkeypatch.setattr(eh, "FLUSH_RETRY_S", 0.01)
    eh.EngineMemoryControl(["http://e0:1", "http://e1:1"], "k", 5.0).release_memory(["weights"])
    for host, flushes in (("e0", 3), ("e1", 1)):
        mine = [p for h, p in seen if h == host]
        # asked what it is first: not the embedded engine (no "engine" in its answer), so the flush goes first
        assert mine == ["/server_info"] + ["/flush_cache"] * flushes + ["/release_memory_occupation"], mine


def test_an_engine_that_refuses_a_busy_release_is_asked_to_release_first(monkeypatch):
    """The embedded engine (GET /server_info names it; asked once per engine) refuses a release while busy instead
    of dying as SGLang does: the release goes first, and only a refusal (400) waits for idle before the next
    try. Any other error is raised; an engine that does not say what it is gets the flush first."""
    seen: list[tuple[str, str]] = []
    busy = {"e0": 0, "e1": 1, "e2": 0}  # e1: its first release is refused, its first flush answers 400 too
    kinds = {"e0": {"engine": "miles-local"}, "e1": {"engine": "miles-local"}, "e2": {"version": "0.5.23"}}

    def handler(req: httpx.Request) -> httpx.Response:
        host, path = req.url.host, req.url.path
        seen.append((host, path))
        if path == "/server_info":
            return httpx.Response(200, json=kinds[host])
        if path in ("/flush_cache", "/release_memory_occupation") and busy[host] > 0:
            if path == "/flush_cache":
                busy[host] -= 1
            return httpx.Response(
                400, json={"error": {"message": "should be called only when server is idle."}}
            )
        return httpx.Response(200)

    monkeypatch.setattr(eh, "_CLIENT", _client(handler))
    monkeypatch.setattr(eh, "FLUSH_RETRY_S", 0.01)
    control = eh.EngineMemoryControl(["http://e0:1", "http://e1:1", "http://e2:1"], "k", 5.0)
    for _ in range(2):
        control.release_memory(["weights"])
    by_host = {h: [p for hh, p in seen if hh == h] for h in busy}
    release, flush, info = "/release_memory_occupation", "/flush_cache", "/server_info"
    assert by_host["e0"] == [info, release, release], by_host
    assert by_host["e1"] == [info, release, flush, flush, release, release], by_host
    assert by_host["e2"] == [info, flush, release, flush, release], by_host  # SGLang: flush first, always
    monkeypatch.setattr(eh, "_CLIENT", _client(lambda req: httpx.Response(500, text="boom")))
    control._refuses_busy = {"http://e0:1": True}
    with pytest.raises(eh.EngineStatusError, match="engine http://e0:1, release_memory_occupation"):
        control.engine_urls = ["http://e0:1"]
        control.release_memory(["weights"])


def test_wait_until_idle_ends_at_its_deadline_naming_the_engine_and_its_last_answer(monkeypatch):
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    monkeypatch.setattr(eh, "_CLIENT", _client(lambda req: httpx.Response(400, text="Flush cache failed.\n")))
    with pytest.raises(eh.EngineTimeout) as e:
        eh.wait_until_idle("http://e0:1", {}, 3.0, "idle before a release", clock=lambda: now[0], sleep=sleep)
    msg = str(e.value)
    assert "engine http://e0:1, flush_cache" in msg and "not idle within 3 s" in msg, msg
    assert "4 tries" in msg and "HTTP 400: Flush cache failed." in msg, msg
    assert sleeps == [1.0, 1.0, 1.0]  # the reference's pace; no sleep past the deadline
    # an engine that is gone is not waited for
    monkeypatch.setattr(
        eh, "_CLIENT", _client(lambda req: (_ for _ in ()).throw(httpx.ConnectError("refused")))
    )
    with pytest.raises(eh.EngineUnreachable):
        eh.wait_until_idle("http://e0:1", {}, 3.0, "idle", clock=lambda: now[0], sleep=sleep)
    assert len(sleeps) == 3


def test_pause_and_continue_send_sglang_bodies_and_check_its_status(monkeypatch):
    seen: list[tuple[str, str, object]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((str(req.url), req.url.path, json.loads(req.content)))
        if req.url.host == "e2":  # an answer without status "ok" (a success-style body) is a failure
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={"message": "Generation paused successfully.", "status": "ok"})

    monkeypatch.setattr(eh, "_CLIENT", _client(handler))
    for mode in eh.PAUSE_MODES:
        eh.pause_generation(["http://e1"], mode, {}, 5.0)
    eh.continue_generation(["http://e1"], {}, 5.0)
    assert [(p, b) for _, p, b in seen] == [
        ("/pause_generation", {"mode": "abort"}),
        ("/pause_generation", {"mode": "retract"}),
        ("/pause_generation", {"mode": "in_place"}),
        ("/continue_generation", {}),
    ]
    with pytest.raises(eh.EngineCallError, match="http://e2.*status is not 'ok'"):
        eh.pause_generation(["http://e1", "http://e2"], "retract", {}, 5.0)
    with pytest.raises(
        ValueError, match="pause mode 'freeze' not supported; allowed: abort, retract, in_place"
    ):
        eh.pause_generation(["http://e1"], "freeze", {}, 5.0)
