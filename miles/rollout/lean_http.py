"""A lean HTTP/1.1 POST for the generation client's JSON requests (`GenerateClient.post` over plain http).

Why: httpx's async stack (client, httpcore's pool, h11, anyio) costs ~1.1-1.5 CPU-ms per request on the rollout
side (~0.1 ms with asyncio streams; 2-core bench machine, one request per prompt group of 4). The fully async
worker sends one request per group, so that was most of its rollout manager's CPU (issue 25, docs/async.md).

What it does: one request per pooled keep-alive connection (asyncio streams, per host and port; a connection idle
longer than `keepalive_expiry` or closed by the server is dropped, not reused), the body encoded as httpx encodes
`json=` (compact, UTF-8, no NaN), headers plus body in one write; the answer read by Content-Length, chunked, or
to the end of the stream. Its failures are httpx's exception types (`httpx.ConnectError`, `httpx.ReadError`,
`httpx.RemoteProtocolError`, `httpx.ReadTimeout`), so the caller's retry and set-aside rules are unchanged. No
redirects (httpx follows none by default either), no TLS: https URLs stay on httpx. `--log-level DEBUG` logs each
request, as httpx does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from miles.utils.httpx_import import lean_httpx

with lean_httpx():
    import httpx

logger = logging.getLogger(__name__)  # DEBUG: each request, as httpx logs its own (docs/monitoring.md)

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter, float]  # reader, writer, idle since (monotonic)


class LeanResponse:
    """The parts of an `httpx.Response` that `GenerateClient.post` reads."""

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code, self.content = status_code, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class LeanPoster:
    """POST JSON over pooled HTTP/1.1 keep-alive connections (see the module docstring)."""

    def __init__(self, headers: dict[str, str], keepalive_expiry: float) -> None:
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self.connections_opened = 0

    @staticmethod
    def takes(url: str) -> bool:
        return url.startswith("http://")

    async def post(self, url: str, body: object, timeout: float) -> LeanResponse:
        parts = urlsplit(url)
        host, port = parts.hostname or "localhost", parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: */*\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{self._extra}\r\n"
        )
        conn = None
        try:
            async with asyncio.timeout(timeout):
                conn = await self._connection(host, port, url)
                reader, writer, _ = conn
                writer.write(head.encode("latin-1") + data)
                status, content, keep = await _read_response(reader, url)
        except TimeoutError as e:
            _close(conn)
            raise httpx.ReadTimeout(f"no answer from {url} within {timeout:g}s") from e
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            _close(conn)
            raise httpx.ReadError(f"{type(e).__name__}: {e}") from e
        except BaseException:
            _close(conn)
            raise
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("HTTP Request: POST %s %d", url, status)
        if keep:
            self._idle.setdefault((host, port), []).append((reader, writer, time.monotonic()))
        else:
            _close(conn)
        return LeanResponse(status, content)

    async def _connection(self, host: str, port: int, url: str) -> _Conn:
        """A pooled connection that is still open and fresh, else a new one."""
        idle = self._idle.get((host, port), [])
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn[2] < self.keepalive_expiry and not conn[0].at_eof() and not conn[1].is_closing():
                return conn
            _close(conn)
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {url}: {e}") from e
        self.connections_opened += 1
        return reader, writer, now

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                _close(conn)
        self._idle.clear()


async def _read_response(reader: asyncio.StreamReader, url: str) -> tuple[int, bytes, bool]:
    """Status, body and whether the connection may be reused."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        raise httpx.RemoteProtocolError(f"{url}: server disconnected without sending a response") from e
    lines = raw.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
        raise httpx.RemoteProtocolError(f"{url}: malformed status line {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    keep = headers.get("connection", "").lower() != "close" and status_line[0] == "HTTP/1.1"
    status = int(status_line[1])
    # no body by definition (RFC 9112 6.3), whatever the headers
    if status in (204, 304) or 100 <= status < 200:
        return status, b"", keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        content = await _read_chunked(reader)
    elif "content-length" in headers:
        content = await reader.readexactly(int(headers["content-length"]))
    else:
        content, keep = await reader.read(), False
    return status, content, keep


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return b"".join(chunks)
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)


def _close(conn: _Conn | None) -> None:
    if conn is not None:
        with contextlib.suppress(Exception):
            conn[1].close()
