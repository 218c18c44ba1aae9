"""Stands in for Ray's runtime-env agent on a local head miles starts itself for a run that asks for no runtime env
(`miles.ray.utils._lean_head`, `asks_no_runtime_env`).

The raylet starts the agent and waits for the HTTP port it persists in the session folder; it then posts to it
only for a task or actor with a runtime env (never for one without). This script binds that port, persists it
and answers every request for a runtime env with a failure that names the cause, so that such a task or actor
fails at once with Ray's RuntimeEnvSetupError carrying this message (a port nobody answered would have the raylet
retry and then exit). It runs in a bare interpreter (standard library only, run by path, never imported): ~50 MB
of PSS and ~0.45 CPU-s less than Ray's agent. It exits when the raylet (its parent) is gone or on SIGTERM.

The replies are Ray's protobuf messages, written by hand: GetOrCreateRuntimeEnvReply and
DeleteRuntimeEnvIfPossibleReply are (1: status, enum AgentRpcStatus, FAILED = 1; 2: error_message, string);
GetRuntimeEnvsInfoReply is empty (no runtime env exists).
"""

import os
import socket
import sys
import threading
import time

# the name Ray persists its runtime-env agent's port under (ray._raylet.RUNTIME_ENV_AGENT_PORT_NAME): "<name>_<node id>"
PORT_NAME = "runtime_env_agent_port"
STATUS_OK, STATUS_FAILED = 0, 1
REFUSAL = (
    "this Ray instance has no runtime-env agent: miles started it for a run that asks for no runtime env "
    "(miles.ray.utils.init_ray), and a task or actor asked for one: {runtime_env}. For runtime envs, start "
    "Ray yourself (`ray start --head`) and point the run at it with RAY_ADDRESS"
)


def option(argv: list[str], name: str) -> str:
    prefix = f"--{name}="
    for arg in argv:
        if arg.startswith(prefix):
            return arg[len(prefix) :]
    raise SystemExit(f"runtime_env_stub: no {prefix} in {argv}")


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while at < len(data):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at
    raise ValueError("truncated varint")


def string_field(data: bytes, number: int) -> str:
    """The first string field `number` of a protobuf message (bytes as sent), "" when absent or unreadable."""
    at = 0
    try:
        while at < len(data):
            key, at = read_varint(data, at)
            kind = key & 7
            if kind == 0:
                _, at = read_varint(data, at)
            elif kind == 2:
                size, at = read_varint(data, at)
                if key >> 3 == number:
                    return data[at : at + size].decode("utf-8", "replace")
                at += size
            elif kind in (1, 5):
                at += 8 if kind == 1 else 4
            else:
                return ""
    except ValueError:
        return ""
    return ""


def status_reply(status: int, message: str) -> bytes:
    text = message.encode()
    return b"\x08" + varint(status) + (b"\x12" + varint(len(text)) + text if text else b"")


def answer(path: str, body: bytes) -> bytes:
    """The reply body to POST `path` with request `body`."""
    if path == "/get_or_create_runtime_env":  # GetOrCreateRuntimeEnvRequest: 1 is serialized_runtime_env
        return status_reply(STATUS_FAILED, REFUSAL.format(runtime_env=string_field(body, 1) or "?"))
    if path == "/delete_runtime_env_if_possible":  # none was created: nothing to delete
        return status_reply(STATUS_OK, "")
    if path == "/get_runtime_envs_info":
        return b""
    return status_reply(STATUS_FAILED, f"runtime_env_stub: unknown path {path}")


def serve(conn: socket.socket) -> None:
    """HTTP/1.1 requests on one connection (the raylet keeps its connections open), until it closes."""
    pending = b""
    with conn:
        while True:
            while b"\r\n\r\n" not in pending:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                pending += chunk
            head, pending = pending.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            path = parts[1] if len(parts) > 1 else ""
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            while len(pending) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                pending += chunk
            body, pending = pending[:length], pending[length:]
            reply = answer(path, body)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                + f"Content-Length: {len(reply)}\r\n\r\n".encode()
                + reply
            )


def accept(server: socket.socket) -> None:
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def persist(session_dir: str, node_id: str, port: int) -> None:
    """Write the port as Ray's persist_port does (a temporary file renamed into place)."""
    path = os.path.join(session_dir, f"{PORT_NAME}_{node_id}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def main(argv: list[str]) -> None:
    raylet = os.getppid()
    host = option(argv, "node-ip-address")
    family, kind, proto, _, address = socket.getaddrinfo(
        host, int(option(argv, "runtime-env-agent-port") or 0), type=socket.SOCK_STREAM
    )[0]
    server = socket.socket(family, kind, proto)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(address)
    server.listen(16)
    threading.Thread(target=accept, args=(server,), daemon=True).start()
    node_id = os.environ.get("RAY_NODE_ID") or option(argv, "node-id")
    persist(option(argv, "session-dir"), node_id, server.getsockname()[1])
    while os.getppid() == raylet:  # re-parented: the raylet exited
        time.sleep(1.0)


if __name__ == "__main__":
    main(sys.argv[1:])
