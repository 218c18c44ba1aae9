"""miles.rollout.lean_http: the generation client's lean POST against a raw asyncio HTTP server (no httpx)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from miles.rollout.generate_client import EngineError, EngineUnavailable, GenerateClient
from miles.rollout.lean_http import LeanPoster


class RawServer:
    """Answers each request with the next scripted reply (bytes after the head, or a callable of the request)."""

    def __init__(self, replies: list) -> None:
        self.replies, self.requests, self.connections = list(replies), [], 0

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                n = int(
                    next(
                        h.split(":")[1] for h in head.split("\r\n") if h.lower().startswith("content-length")
                    )
                )
                body = await reader.readexactly(n)
                self.requests.append((head, body))
                reply = self.replies.pop(0)
                if reply == "close":
                    writer.close()
                    return
                if reply == "hang":
                    await asyncio.sleep(30)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def ok(obj: object, extra: str = "") -> bytes:
    data = json.dumps(obj).encode()
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(data)}\r\n{extra}\r\n".encode() + data


def test_json_round_trip_reuses_one_connection_and_encodes_as_httpx() -> None:
    body = {"input_ids": [[1, 2], [3]], "text": "é", "p": 0.5}

    async def go() -> None:
        async with RawServer([ok({"a": 1}), ok([{"b": 2}])]) as srv:
            poster = LeanPoster({"Authorization": "Bearer k"}, keepalive_expiry=2.0)
            assert (await poster.post(f"{srv.url}/generate", body, 5.0)).json() == {"a": 1}
            assert (await poster.post(f"{srv.url}/generate", body, 5.0)).json() == [{"b": 2}]
            await poster.aclose()
            assert srv.connections == 1 and poster.connections_opened == 1
            head, sent = srv.requests[0]
            assert head.startswith("POST /generate HTTP/1.1\r\n") and "Authorization: Bearer k\r\n" in head
            assert sent == httpx.Request("POST", srv.url, json=body).content  # byte for byte httpx's encoding

    asyncio.run(go())


def test_chunked_answer_and_connection_close() -> None:
    chunked = b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{"x\r\n4\r\n":1}\r\n0\r\n\r\n'

    async def go() -> None:
        async with RawServer([chunked, ok({"y": 2}, "connection: close\r\n"), ok({"z": 3})]) as srv:
            poster = LeanPoster({}, keepalive_expiry=2.0)
            assert (await poster.post(srv.url + "/g", {}, 5.0)).json() == {"x": 1}
            assert (await poster.post(srv.url + "/g", {}, 5.0)).json() == {"y": 2}
            assert (await poster.post(srv.url + "/g", {}, 5.0)).json() == {"z": 3}
            assert poster.connections_opened == 2  # the one the server closed is not reused
            await poster.aclose()

    asyncio.run(go())


def test_idle_connection_closed_by_server_is_not_reused() -> None:
    async def go() -> None:
        async with RawServer([ok({}), "close", ok({"again": 1})]) as srv:
            poster = LeanPoster({}, keepalive_expiry=2.0)
            await poster.post(srv.url + "/g", {}, 5.0)
            with pytest.raises(httpx.RemoteProtocolError):  # closed while answering: httpx's type
                await poster.post(srv.url + "/g", {}, 5.0)
            assert (await poster.post(srv.url + "/g", {}, 5.0)).json() == {"again": 1}
            await poster.aclose()

    asyncio.run(go())


def test_errors_are_httpx_types() -> None:
    async def go() -> None:
        async with RawServer(["hang"]) as srv:
            poster = LeanPoster({}, keepalive_expiry=2.0)
            with pytest.raises(httpx.TimeoutException):
                await poster.post(srv.url + "/g", {}, 0.2)
            url = srv.url
        with pytest.raises(httpx.ConnectError):
            await poster.post(url + "/g", {}, 1.0)  # the server is gone

    asyncio.run(go())


def test_generate_client_post_uses_it_with_the_same_rules() -> None:
    busy = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy"
    bad = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\n\r\nbad"

    async def go() -> None:
        async with RawServer([ok({"k": 1}), busy, bad]) as srv:
            async with GenerateClient(srv.url, [srv.url], "key", timeout=5.0, concurrency=4) as client:
                assert client._lean is not None
                assert await client.post(f"{srv.url}/generate", {"a": 1}, "phase") == {"k": 1}
                with pytest.raises(EngineUnavailable, match="503"):
                    await client.post(f"{srv.url}/generate", {}, "phase", retry=False)
                with pytest.raises(EngineError, match="400: bad"):
                    await client.post(f"{srv.url}/generate", {}, "phase", retry=False)
            assert "Authorization: Bearer key\r\n" in srv.requests[0][0]

    asyncio.run(go())


def test_no_body_status_is_read_without_waiting_for_the_server_to_close() -> None:
    # a 204 carries no length: reading to the end would wait for the server's idle close
    async def go() -> None:
        async with RawServer([b"HTTP/1.1 204 No Content\r\n\r\n", ok({"next": 1})]) as srv:
            poster = LeanPoster({}, keepalive_expiry=2.0)
            answer = await poster.post(srv.url + "/g", {}, 2.0)
            assert answer.status_code == 204 and answer.content == b""
            assert (await poster.post(srv.url + "/g", {}, 2.0)).json() == {"next": 1}
            assert poster.connections_opened == 1  # the connection stayed usable
            await poster.aclose()

    asyncio.run(go())
