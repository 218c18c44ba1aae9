"""Stands in for Ray's dashboard agent on a local head miles starts itself (`miles.ray.utils._lean_head`).

The raylet starts a dashboard agent and waits for the ports it persists in the session folder; the minimal agent
(`--minimal`, no metrics, no HTTP or gRPC server) persists -1 for each, meaning "not served", and then only waits
for the raylet to exit. This script does the same in a bare interpreter (standard library only, run by path,
never imported): ~80 MB of PSS and ~0.9 CPU-s less than Ray's agent. It takes the agent's command line, writes the
three ports as -1 and exits when the raylet (its parent) is gone or on SIGTERM.
"""

import os
import sys
import time

# the names Ray persists its dashboard agent's ports under (ray._raylet's *_PORT_NAME), each "<name>_<node id>"
PORT_NAMES = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")


def option(argv: list[str], name: str) -> str:
    prefix = f"--{name}="
    for arg in argv:
        if arg.startswith(prefix):
            return arg[len(prefix) :]
    raise SystemExit(f"agent_stub: no {prefix} in {argv}")


def persist_unserved(session_dir: str, node_id: str) -> None:
    """Write -1 as each port, as Ray's persist_port does (a temporary file renamed into place)."""
    for name in PORT_NAMES:
        path = os.path.join(session_dir, f"{name}_{node_id}")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("-1")
        os.replace(tmp, path)


def main(argv: list[str]) -> None:
    raylet = os.getppid()
    persist_unserved(option(argv, "session-dir"), os.environ.get("RAY_NODE_ID") or option(argv, "node-id"))
    while os.getppid() == raylet:  # re-parented: the raylet exited
        time.sleep(1.0)


if __name__ == "__main__":
    main(sys.argv[1:])
