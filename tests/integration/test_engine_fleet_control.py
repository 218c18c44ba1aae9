"""`post_to_engines`: the fleet's control calls (release/resume/flush) reach every engine at once, each with its
own deadline, and a failure names the engine URL, the endpoint and the phase."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from miles.utils.engine_control_http import (
    EngineStatusError,
    EngineTimeout,
    EngineUnreachable,
    post_to_engines,
)
from miles.utils.net import free_port


class _Engines(http.server.ThreadingHTTPServer):
    """Engines at ``{url}/e0``, ``{url}/e1``, ...: ``ok`` answers only once ``together`` requests are in flight
    at the same time (a barrier), ``bad`` answers 500, ``hung`` answers after 3 s."""

    def __init__(self, together: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.barrier = threading.Barrier(together, timeout=5)
        self.seen: list[tuple[str, dict]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Engines

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        engine, _, endpoint = self.path.strip("/").partition("/")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.seen.append((f"{engine}/{endpoint}", body))
        status = 200
        if engine.startswith("ok"):
            try:
                self.server.barrier.wait()
            except threading.BrokenBarrierError:
                status = 503  # the calls did not overlap
        elif engine == "bad":
            status = 500
        elif engine == "hung":
            time.sleep(3)
        data = b"{}"
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def engines() -> Iterator[_Engines]:
    server = _Engines(together=3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_control_calls_reach_every_engine_at_once(engines: _Engines) -> None:
    urls = [f"{engines.url}/ok{i}" for i in range(3)]
    # each engine answers only while all three calls are in flight: one after another would time out there
    post_to_engines(
        urls, "/release_memory_occupation", {"tags": ["weights"]}, {}, timeout_s=10, what="engine control"
    )
    assert sorted(engines.seen) == [
        (f"ok{i}/release_memory_occupation", {"tags": ["weights"]}) for i in range(3)
    ]


def test_a_failure_names_its_engine_and_the_others_still_get_the_call(engines: _Engines) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    urls = [f"{engines.url}/hung", f"{engines.url}/bad", dead, f"{engines.url}/fine"]
    engines.barrier = threading.Barrier(1)  # "fine" answers at once
    with pytest.raises(
        EngineTimeout, match=r"engine .*/hung, resume_memory_occupation, engine control, phase request"
    ) as err:
        post_to_engines(urls, "resume_memory_occupation", {}, {}, timeout_s=1, what="engine control")
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert f"{engines.url}/bad failed too" in notes and "HTTP 500" in notes
    assert f"{dead} failed too" in notes and "a dead engine ends the run" in notes
    assert "fine/resume_memory_occupation" in [p for p, _ in engines.seen]


def test_one_engine_errors_keep_their_type(engines: _Engines) -> None:
    with pytest.raises(EngineStatusError, match=r"engine .*/bad, flush_cache, engine control, phase status"):
        post_to_engines([f"{engines.url}/bad"], "flush_cache", {}, {}, timeout_s=5, what="engine control")
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnreachable, match="a dead engine ends the run unless --use-fault-tolerance"):
        post_to_engines(
            [dead, f"{engines.url}/bad"], "flush_cache", {}, {}, timeout_s=5, what="engine control"
        )
