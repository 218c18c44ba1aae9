"""Engine control over HTTP: the one synchronous layer the driver (launch, health, memory release and resume,
`EngineMemoryControl`) and the trainer's refit (through `miles.refit.engine_endpoints`) talk to engine servers
(and sglang-router) with: keys, deadlines, success checks and errors. Generation is not here.

- Keys: `bearer` builds the Authorization header from a key, `engine_headers` applies SGLang's rule for which
  key an endpoint takes (the admin key on `ADMIN_ENDPOINTS` when one is set, the API key everywhere else);
  `launch_keys` gives an engine miles launches the run's key as both.
- One long-lived `httpx.Client` per process (`http_client`: its connection pool and TLS context are built once,
  not per call); every call passes its own deadline (`timeout_s`) and headers. It ignores proxy variables
  (`trust_env=False`): engines are reached directly.
- Errors: every failure is an `EngineCallError` naming the server URL, the endpoint, what the call was for and
  the phase: `request` (no answer within the deadline: `EngineTimeout`; no connection: `EngineUnreachable`),
  `status` (an error status: `EngineStatusError`, with `.status` and `.body`) or `response` (not JSON, or
  SGLang's `success` field false where `require_success` asks for it).

The rollout's async generation client (`miles.rollout.generate_client.GenerateClient`) keeps its own pooled
`httpx.AsyncClient` and takes its header from `bearer`. Torch-free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from miles.utils.hang_dump import expired
from miles.utils.httpx_import import lean_httpx, lean_transport
from miles.utils.types import JSON

with lean_httpx():  # not its command-line client's imports (~0.1 s of CPU per process)
    import httpx

# The engines this very process serves (a CPU training rank's in-process engine), by URL: an admin call a caller
# in this process makes to one of them skips HTTP (the client's and the server's CPU in one process). The engine
# side registers its direct call (`miles.engines.local.in_process`); the refit looks it up (`miles.refit.window`),
# so neither imports the other.
AdminCall = Callable[
    [str, Mapping[str, object], float], dict[str, JSON]
]  # (op, the endpoint's body, timeout)
_SERVED_HERE: dict[str, AdminCall] = {}


def serve_here(url: str, call: AdminCall) -> None:
    """Register `call` as the direct admin call of the engine this process serves at `url`."""
    _SERVED_HERE[url] = call


def unserve_here(url: str, call: AdminCall) -> None:
    """Drop `url`'s registration if it still is `call` (an engine launched since at the same URL keeps its own)."""
    if _SERVED_HERE.get(url) == call:
        del _SERVED_HERE[url]


def served_here(url: str) -> AdminCall | None:
    """The direct admin call of the engine this process serves at `url` (None: none, or another process's)."""
    return _SERVED_HERE.get(url)


# Endpoints SGLang marks ADMIN_OPTIONAL (sglang/srt/entrypoints/http_server.py): an admin key unlocks them.
ADMIN_ENDPOINTS = frozenset(
    "/" + name
    for name in (
        "abort_request", "pause_generation", "continue_generation", "flush_cache", "update_weights_from_tensor",
        "update_weights_from_disk", "update_weights_from_distributed", "init_weights_update_group",
        "destroy_weights_update_group", "begin_weight_update", "end_weight_update", "release_memory_occupation",
        "resume_memory_occupation", "get_weights_by_name", "weights_checker", "update_weight_version",
    )
)  # fmt: skip

_CLIENT: httpx.Client | None = None
_CLIENT_LOCK = threading.Lock()


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header that presents `key` (no header without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def launch_keys(key: str | None) -> dict[str, str | None]:
    """The keys miles launches an engine with (`EngineProcess` arguments): the run's key as both SGLang's
    `--api-key` and `--admin-api-key`. With the admin key alone SGLang leaves every other endpoint open, and its
    keyless `GET /server_info` answers `admin_api_key` and the launch command in clear; with both, only /health*,
    /ready* and /metrics* answer without the key (docs/sglang-contract.md)."""
    return {"api_key": key, "admin_api_key": key}


def engine_headers(endpoint: str, api_key: str | None, admin_api_key: str | None) -> dict[str, str]:
    """SGLang's rule: an admin endpoint takes the admin key when one is set, every other one the API key."""
    path = "/" + endpoint.lstrip("/")
    return bearer(admin_api_key if path in ADMIN_ENDPOINTS and admin_api_key else api_key)


def http_client() -> httpx.Client:
    """The process's one HTTP client for engine and router calls (built on first use)."""
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None:
            with lean_transport():  # not trio (~0.07 s of CPU)
                _CLIENT = httpx.Client(trust_env=False)
        return _CLIENT


class EngineCallError(RuntimeError):
    """A call to an engine (or the router: `server`) failed: `url`, `endpoint` (no leading slash), `what` it
    was for, `phase`."""

    def __init__(
        self, url: str, endpoint: str, what: str, phase: str, detail: str, server: str = "engine"
    ) -> None:
        self.url, self.endpoint, self.what, self.phase, self.server = url, endpoint, what, phase, server
        self._args: tuple[object, ...] = (url, endpoint, what, phase, detail, server)
        where = f"{server} {url}, {endpoint}" + (f", {what}" if what else "")
        super().__init__(f"{where}, phase {phase}: {detail}")

    def __reduce__(self) -> tuple[type[EngineCallError], tuple[object, ...]]:
        """Rebuilt from the constructor's arguments (Ray ships errors between processes by pickle)."""
        return type(self), self._args


class EngineTimeout(EngineCallError, TimeoutError):
    """No answer within the call's deadline (phase request)."""


class EngineUnreachable(EngineCallError, ConnectionError):
    """No connection, or the connection dropped (phase request): the server process is likely gone."""


class EngineStatusError(EngineCallError):
    """The server answered an error status (phase status); `status` and `body` are its answer."""

    def __init__(
        self, url: str, endpoint: str, what: str, status: int, body: str, server: str = "engine"
    ) -> None:
        super().__init__(url, endpoint, what, "status", f"HTTP {status}: {body[:2000]}", server)
        self.status, self.body = status, body
        self._args = (url, endpoint, what, status, body, server)


@dataclass(frozen=True)
class Answer:
    """A 2xx answer (`response`) and the call it answers, so that decoding errors name the call too."""

    response: httpx.Response
    url: str
    endpoint: str
    what: str
    server: str

    def _error(self, detail: str) -> EngineCallError:
        return EngineCallError(self.url, self.endpoint, self.what, "response", detail, self.server)

    def json(self, require_success: bool = False) -> JSON:
        """The JSON body (None when empty: SGLang answers some control calls with no body); with
        `require_success`, it must be an object whose `success` is true (SGLang's control endpoints report
        refusals that way, with a `message`). Phase response errors otherwise."""
        answer: JSON = None
        if self.response.content.strip():
            try:
                answer = self.response.json()
            except ValueError as exc:
                raise self._error(f"not JSON: {self.response.text[:500]!r}") from exc
        if require_success and (not isinstance(answer, dict) or not answer.get("success", False)):
            message = answer.get("message", answer) if isinstance(answer, dict) else answer
            raise self._error(f"success=false: {message}")
        return answer

    def json_object(self, require_success: bool = False) -> dict[str, JSON]:
        """`json` that must be a JSON object."""
        answer = self.json(require_success)
        if not isinstance(answer, dict):
            raise self._error(f"not a JSON object: {answer!r}")
        return answer


def request(
    method: str,
    url: str,
    endpoint: str,
    what: str,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    body: object = None,
    client: httpx.Client | None = None,
    server: str = "engine",
) -> Answer:
    """`method` `{url}/{endpoint}` (JSON `body`) within `timeout_s`; returns the answer when its status is 2xx,
    raises `EngineTimeout`, `EngineUnreachable` or `EngineStatusError` otherwise. `client`: default
    `http_client()` (tests pass one on an `httpx.MockTransport`); `server`: how errors name it."""
    name = endpoint.lstrip("/")
    try:
        resp = (client or http_client()).request(
            method, f"{url}/{name}", json=body, headers=dict(headers or {}), timeout=timeout_s
        )
    except httpx.TimeoutException as exc:
        detail = expired(f"{type(exc).__name__}: {exc} (no answer within {timeout_s:g} s)", f"{server} {url}")
        raise EngineTimeout(url, name, what, "request", detail, server) from exc
    except httpx.HTTPError as exc:
        raise EngineUnreachable(url, name, what, "request", f"{type(exc).__name__}: {exc}", server) from exc
    if not resp.is_success:
        raise EngineStatusError(url, name, what, resp.status_code, resp.text, server)
    return Answer(resp, url, name, what, server)


def post_to_engines(
    urls: list[str], endpoint: str, body: object, headers: Mapping[str, str], timeout_s: float, what: str
) -> None:
    """POST `body` to `endpoint` of every engine in `urls` at once (one thread per engine beyond the first),
    each within `timeout_s`; every engine gets the call even when another fails, then the first failure in `urls`
    order is raised (`request`'s errors, naming the engine URL, endpoint and phase) with the others as notes; an
    engine that cannot be reached is named as ending the run (`--use-fault-tolerance` restarts dead engines
    between calls, not during one)."""

    on_every_engine(urls, lambda url: request("POST", url, endpoint, what, timeout_s, headers, body))


def on_every_engine(urls: list[str], call: Callable[[str], object]) -> None:
    """`call(url)` for every engine at once (one thread per engine beyond the first); every engine gets the call
    even when another fails, then the first failure in `urls` order is raised with the others as notes, an
    unreachable engine named as ending the run."""

    def one(url: str) -> None:
        try:
            call(url)
        except EngineUnreachable as e:  # refused, reset: the engine process is gone
            raise EngineUnreachable(
                url, e.endpoint, e.what, e.phase,
                f"cannot reach the engine ({e.__cause__!r}); a dead engine ends the run unless "
                "--use-fault-tolerance restarts it",
            ) from e  # fmt: skip

    errors: list[BaseException | None] = [None] * len(urls)

    def run(i: int) -> None:
        try:
            one(urls[i])
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, len(urls))]
    for t in threads:
        t.start()
    if urls:
        run(0)
    for t in threads:
        t.join()
    failed = [e for e in errors if e is not None]
    if failed:
        first = failed[0]
        for other in failed[1:]:
            where = other.url if isinstance(other, EngineCallError) else "an engine"
            first.add_note(f"{where} failed too: {other}")
        raise first


FLUSH_RETRY_S = 1.0  # between two /flush_cache tries of a release (the reference's pace)


def wait_until_idle(
    url: str,
    headers: Mapping[str, str],
    timeout_s: float,
    what: str,
    retry_s: float = FLUSH_RETRY_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """POST /flush_cache to the engine at `url` until it succeeds, at most `timeout_s` seconds; returns the number
    of tries. SGLang flushes only when no request runs or waits (paused: none runs) and answers 400 otherwise,
    and a `/release_memory_occupation` on a busy engine fails an assertion in its scheduler, which ends the
    engine: a release comes after a successful flush (as the reference does, retrying the flush once a second).
    At the deadline: `EngineTimeout` naming the engine and its last answer."""
    deadline = clock() + timeout_s
    tries = 0
    while True:
        tries += 1
        try:
            request("POST", url, "flush_cache", what, max(0.1, deadline - clock()), headers)
            return tries
        except EngineStatusError as e:
            last = f"HTTP {e.status}: {e.body.strip()[:300]}"
        if clock() + retry_s > deadline:
            raise EngineTimeout(
                url, "flush_cache", what, "request",
                expired(
                    f"the engine was not idle within {timeout_s:g} s ({tries} tries of /flush_cache, the last "
                    f"answered {last}); a release waits for running requests to end",
                    f"engine {url}",
                ),
            )  # fmt: skip
        sleep(retry_s)


# What the embedded engine (`miles.engines.local`) names itself in GET /server_info's "engine" field. It refuses a
# release while busy (HTTP 400, nothing released) where SGLang's scheduler fails an assertion and dies.
EMBEDDED_ENGINE = "miles-local"


def refuses_busy_release(url: str, headers: Mapping[str, str], timeout_s: float) -> bool:
    """Whether the engine at `url` answers a release while busy with a refusal (the embedded engine) rather than
    dying (SGLang): GET /server_info names it. Any failure to tell counts as SGLang (flush first)."""
    try:
        info = request("GET", url, "server_info", "engine control: engine kind", timeout_s, headers).json()
    except EngineCallError:
        return False
    return isinstance(info, dict) and info.get("engine") == EMBEDDED_ENGINE


class EngineMemoryControl:
    """Release/resume engine memory (`miles.ray.colocate.EngineMemory`): each call goes to every engine at once.
    The driver holds one (no Ray hop through the EngineFleet actor, which cost ~4.5 ms per call of the
    quickstart's three per step), and so does a training rank that resumes the engines itself before a refit."""

    def __init__(self, engine_urls: list[str], api_key: str | None, timeout: float) -> None:
        self.engine_urls, self.headers, self.timeout = list(engine_urls), bearer(api_key), timeout
        self._refuses_busy: dict[str, bool] = {}  # engine URL -> `refuses_busy_release` (asked once)

    def release_memory(self, tags: list[str]) -> None:
        """Each engine: `wait_until_idle` (within the timeout), then POST /release_memory_occupation. An engine
        that refuses a busy release instead of dying (the embedded engine, `refuses_busy_release`) is asked to
        release first, and waited for only when it refuses (HTTP 400): one round trip per step instead of two."""

        def release(url: str) -> None:
            if url not in self._refuses_busy:
                self._refuses_busy[url] = refuses_busy_release(url, self.headers, self.timeout)
            if self._refuses_busy[url]:
                try:
                    self._post_release(url, tags)
                    return
                except EngineStatusError as e:
                    if e.status != 400:  # 400: busy (anything else wrong is raised again after the wait)
                        raise
            wait_until_idle(url, self.headers, self.timeout, "engine control: idle before a release")
            self._post_release(url, tags)

        on_every_engine(self.engine_urls, release)

    def _post_release(self, url: str, tags: list[str]) -> None:
        request(
            "POST", url, "release_memory_occupation", "engine control", self.timeout, self.headers,
            {"tags": tags},
        )  # fmt: skip

    def resume_memory(self, tags: list[str]) -> None:
        self._post("/resume_memory_occupation", tags)

    def _post(self, endpoint: str, tags: list[str]) -> None:
        post_to_engines(
            self.engine_urls, endpoint, {"tags": tags}, self.headers, self.timeout, "engine control"
        )


# SGLang 0.5.23's `PauseGenerationReqInput.mode` (default "abort"): abort returns every running and queued request
# with its partial output (finish reason abort); retract sends running requests back to the queue, freeing their
# KV cache, to be recomputed after /continue_generation; in_place freezes them, KV cache kept.
PAUSE_MODES = ("abort", "retract", "in_place")


def _require_ok(answer: Answer) -> None:
    """SGLang answers /pause_generation and /continue_generation with {"message", "status": "ok"}, not `success`."""
    body = answer.json_object()
    if body.get("status") != "ok":
        raise answer._error(f"status is not 'ok': {body}")


def pause_generation(
    urls: list[str], mode: str, headers: Mapping[str, str], timeout_s: float, what: str = "pause generation"
) -> None:
    """POST /pause_generation {"mode": mode} to every engine in `urls` (at once, `on_every_engine`'s errors). New
    requests wait until `continue_generation`; weight updates are allowed meanwhile in every mode (under
    in_place, with flush_cache=false while requests are held: SGLang fails a flushing update then)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} not supported; allowed: {', '.join(PAUSE_MODES)}")
    body = {"mode": mode}
    on_every_engine(
        urls,
        lambda url: _require_ok(request("POST", url, "pause_generation", what, timeout_s, headers, body)),
    )


def continue_generation(
    urls: list[str], headers: Mapping[str, str], timeout_s: float, what: str = "continue generation"
) -> None:
    """POST /continue_generation to every engine in `urls`: paused requests go on (retracted ones are
    recomputed first, with the weights served now), waiting ones are admitted."""
    on_every_engine(
        urls,
        lambda url: _require_ok(request("POST", url, "continue_generation", what, timeout_s, headers, {})),
    )


def post_engine(
    url: str, endpoint: str, body: dict, headers: Mapping[str, str], timeout_s: float, what: str
) -> dict[str, JSON]:
    """POST `body` to one of SGLang's control endpoints and require `success`; returns the answer."""
    return request("POST", url, endpoint, what, timeout_s, headers, body).json_object(require_success=True)


def get_engine_json(
    url: str, endpoint: str, headers: Mapping[str, str], timeout_s: float, what: str
) -> dict[str, JSON]:
    """GET a JSON object (e.g. `/model_info`)."""
    return request("GET", url, endpoint, what, timeout_s, headers).json_object()


def health_problem(url: str, endpoint: str = "/health", timeout_s: float = 5.0) -> str | None:
    """Why `GET {url}{endpoint}` did not answer 200 within `timeout_s` (None: it did), for health checks that
    poll rather than fail."""
    try:
        resp = http_client().get(f"{url}{endpoint}", timeout=timeout_s)
    except httpx.TimeoutException:
        return f"no answer to {endpoint} within {timeout_s:.0f}s"
    except httpx.HTTPError as exc:
        return f"{endpoint}: {type(exc).__name__}: {exc}"
    return None if resp.status_code == 200 else f"{endpoint} answered {resp.status_code}"
