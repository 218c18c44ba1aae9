"""Addresses and ports: the one place miles asks the OS for a free port or this machine's address."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` ("" for every interface) that the OS reported free a moment ago (bind to port 0).
    Another process may take it before the caller binds; callers that launch a server retry on a clash."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """This machine's outward-facing IPv4 address (no packet is sent); 127.0.0.1 when there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
