"""Launch a rollout engine server process (SGLang or the embedded engine) and talk to it over HTTP.

`EngineProcess` is a plain object (no Ray); `make_engine_actor_class()` wraps it in a thin Ray actor on demand, so
importing this module imports neither ray nor sglang.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from miles.engines.managed_server import EngineStartupError, ManagedServer
from miles.engines.sglang_args import flag_args, sglang_seeds_requests
from miles.engines.sglang_launch import ADMIN_API_KEY_ENV, API_KEY_ENV
from miles.utils.engine_control_http import EngineStatusError, engine_headers, health_problem, request
from miles.utils.net import free_port, node_ip
from miles.utils.types import JSON

if TYPE_CHECKING:
    from miles.ray.placement import EngineGPUs

# server flags by name (`mem_fraction_static` or `mem-fraction-static`): a string, a number, or a bool switch
FlagValues = Mapping[str, object]

logger = logging.getLogger(__name__)

ENGINE_KINDS = ("auto", "sglang", "local")
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


__all__ = ["EngineHTTPError", "EngineProcess", "EngineStartupError"]

# An engine answered with an HTTP error status (`.status`, `.body`): the shared client's error.
EngineHTTPError = EngineStatusError


def resolve_engine_kind(requested: str, gpu: bool | None = None) -> str:
    """'auto' -> 'sglang' when sglang imports and there are GPUs, else 'local'. Validates explicit kinds.

    `gpu`: whether the engines get GPUs (the placement knows: the engine fleet passes it, so that its process
    never imports torch); None asks `torch.cuda.is_available()` in this process."""
    if requested not in ENGINE_KINDS:
        raise ValueError(f"engine kind {requested!r} not supported; allowed: {list(ENGINE_KINDS)}")
    has_sglang = importlib.util.find_spec("sglang") is not None
    if requested == "sglang":
        if not has_sglang:
            raise ValueError(
                "engine kind 'sglang' needs the sglang package, which is not installed; install the gpu extra "
                "with `pip install 'miles[gpu]'`, or use the embedded engine (engine kind 'local')"
            )
        return "sglang"
    if requested == "local":
        return "local"
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    kind = "sglang" if has_sglang and gpu else "local"
    logger.info("engine kind auto -> %s (sglang installed: %s, GPUs: %s)", kind, has_sglang, gpu)
    return kind


def _flag_args(args: FlagValues | None) -> list[str]:
    """{'mem_fraction_static': '0.7', 'enable-x': True, 'enable_y': ''} -> ['--mem-fraction-static=0.7',
    '--enable-x', '--enable-y']: see `miles.engines.sglang_args.flag_args` (a value-less flag is bare, every
    value rides in its flag's token)."""
    return flag_args(args)


class EngineLaunchKwargs(TypedDict):
    """The per-engine keyword arguments of `EngineProcess` that `engine_launch_kwargs` makes."""

    sglang_args: dict[str, object]
    local_args: dict[str, object]
    env: dict[str, str]


def engine_launch_kwargs(
    kind: str,
    index: int,
    rollout_seed: int,
    colocate: bool,
    sglang_args: FlagValues | None = None,
    local_args: FlagValues | None = None,
    return_routed_experts: bool = False,
) -> EngineLaunchKwargs:
    """The per-engine part of an `EngineProcess`'s arguments, as SGLang 0.5.23 needs them:

    - `random_seed = rollout_seed + index` (SGLang draws a random seed per launch otherwise); a seed the user set
      through `--sglang-random-seed` wins;
    - colocated SGLang engines get `--enable-memory-saver` and `SGLANG_MEMORY_SAVER_CUDA_GRAPH=true`, without
      which `/release_memory_occupation` frees nothing (torch_memory_saver regions are made only then);
    - `return_routed_experts` (R3, `--use-rollout-routing-replay`): `--enable-return-routed-experts`, without
      which both engines accept a request's `return_routed_experts` and answer no `routed_experts`.
    SGLang honours a request's `sampling_seed` only with `--enable-deterministic-inference` (or
    `--rl-on-policy-target`, which sets it); without it the first engine's launch warns that rollouts are not
    reproducible from `--rollout-seed` (docs/gpu.md). Returns {"sglang_args", "local_args", "env"}.
    """
    sglang, local, env = dict(sglang_args or {}), dict(local_args or {}), {}
    seed = rollout_seed + index
    if kind == "sglang":
        if index == 0 and not sglang_seeds_requests(sglang):
            logger.warning(
                "SGLang engines ignore each request's sampling_seed without --sglang-enable-deterministic-"
                "inference: rollouts are not reproducible from --rollout-seed %d (set that flag to make them "
                "so, at the cost of SGLang's batch-invariant kernels)",
                rollout_seed,
            )
        sglang.setdefault("random_seed", str(seed))
        if colocate:
            sglang["enable_memory_saver"] = True
            env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "true"
    else:
        local.setdefault("random-seed", seed)
    if return_routed_experts and kind == "sglang":
        sglang.setdefault("enable_return_routed_experts", True)
    elif return_routed_experts:
        local.setdefault("enable-return-routed-experts", True)
    return {"sglang_args": sglang, "local_args": local, "env": env}


class EngineCalls(ABC):
    """An engine's control calls, keyed by SGLang's rule (`miles.utils.engine_control_http.engine_headers`);
    errors name the engine, the endpoint and the phase (`EngineHTTPError` on an error status)."""

    api_key: str | None
    admin_api_key: str | None

    @property
    @abstractmethod
    def url(self) -> str:
        """The engine's base URL, e.g. http://127.0.0.1:31000."""

    def post(self, path: str, json: object = None, timeout: float = 600.0) -> JSON:
        """POST JSON to the engine; returns the decoded answer (None when empty)."""
        headers = engine_headers(path, self.api_key, self.admin_api_key)
        return request("POST", self.url, path, "", timeout, headers, json).json()

    def get(self, path: str, timeout: float = 60.0) -> JSON:
        """GET from the engine; returns the decoded answer (None when empty)."""
        headers = engine_headers(path, self.api_key, self.admin_api_key)
        return request("GET", self.url, path, "", timeout, headers).json()


class EngineProcess(EngineCalls, ManagedServer):
    """One rollout engine server: its process (a `ManagedServer`), its URL and its control calls.

    `admin_api_key` is the server's `--admin-api-key` (required on the admin endpoints only: generation
    stays open, so the router and rollout requests carry no key); `api_key` is its `--api-key`, which guards
    every endpoint but /health. Both reach the server by environment (`MILES_ENGINE_API_KEY`,
    `MILES_ENGINE_ADMIN_API_KEY`), never on its command line, which any local user can read in /proc; SGLang is
    started through `miles.engines.sglang_launch`, which moves them onto its in-process argv.
    `python` runs the server (default: this interpreter).
    """

    log_prefix = "miles-engine"

    def __init__(
        self,
        model_path: str,
        kind: str = "local",
        host: str = "127.0.0.1",
        port: int | None = None,
        tp_size: int = 1,
        sglang_args: FlagValues | None = None,
        local_args: FlagValues | None = None,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        startup_timeout: float = 600.0,
        admin_api_key: str | None = None,
        python: str | None = None,
    ):
        if kind not in ("sglang", "local"):
            raise ValueError(
                f"kind {kind!r} not supported; allowed: 'sglang', 'local' (resolve 'auto' first)"
            )
        if kind == "local" and tp_size != 1:
            raise ValueError(f"tp_size={tp_size}: the embedded engine supports only tp_size=1")
        super().__init__(log_path)
        self.model_path = str(model_path)
        self.kind = kind
        self.host = host
        self.port = port
        self.tp_size = tp_size
        self.sglang_args = dict(sglang_args or {})
        self.local_args = dict(local_args or {})
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.python = python or sys.executable
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.server_name = f"{kind} engine"

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. http://127.0.0.1:31000 (a wildcard bind is named by this node's IP)."""
        if self.port is None:
            raise RuntimeError("engine not launched yet: no port")
        host = node_ip() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        """The server command line (needs `port` set)."""
        # one token per valued flag (`--NAME=VALUE`): a value starting with '-' is not read as a flag
        common = [f"--model-path={self.model_path}", f"--host={self.host}", f"--port={self.port}"]
        if self.kind == "sglang":
            launcher = [self.python, "-m", "miles.engines.sglang_launch"]
            return launcher + common + [f"--tp-size={self.tp_size}"] + _flag_args(self.sglang_args)
        return [self.python, "-m", "miles.engines.local", *common] + _flag_args(self.local_args)

    def launch_env(self) -> dict[str, str]:
        """The server's environment: this process's, `env`, and the keys (never on the command line)."""
        env = {**os.environ, **self.env}
        env.setdefault("HF_HUB_OFFLINE", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
        for name, key in ((API_KEY_ENV, self.api_key), (ADMIN_API_KEY_ENV, self.admin_api_key)):
            if key:
                env[name] = key
            else:
                env.pop(name, None)
        return env

    def launch(self) -> EngineProcess:
        """Start the server on a free port (unless one was given) and wait for /health; returns self."""
        if self.proc is not None:
            raise RuntimeError(f"engine already launched at {self.url}")
        if self.port is None:
            self.port = free_port(self.host if self.host != "0.0.0.0" else "127.0.0.1")
        self.start(self.command(), self.port, self.launch_env())
        try:
            self.wait_healthy(self.startup_timeout)
        except BaseException:
            self.shutdown()  # do not leave a half-started server behind
            raise
        return self

    def wait_healthy(self, timeout: float) -> None:
        """Poll GET /health until it answers 200; EngineStartupError if the process dies or time runs out."""
        self.wait_until(
            lambda: health_problem(self.url) is None, time.monotonic() + timeout, "waiting for /health"
        )

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (its process group has the same id)."""
        return self.proc.pid if self.proc is not None else None

    def shutdown(self, timeout: float = 15.0) -> None:
        """Terminate the server (SIGTERM to its process group), then kill it if it lingers."""
        self.stop(signal.SIGTERM, timeout)

    def kill(self, timeout: float = 15.0) -> None:
        """SIGKILL the server's process group at once (it may be stopped or hung) and reap it."""
        self.stop(signal.SIGKILL, timeout)

    def restart(self) -> EngineProcess:
        """Kill the server and start a fresh one on the same host and port (so its URL does not change); waits
        for /health like `launch`. The fresh server holds the weights of `model_path`: refit it before use."""
        self.kill()
        return self.launch()

    def __enter__(self) -> EngineProcess:
        return self.launch() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# A GPU engine with tp_size > 1 spans several bundles' GPUs, so its actor must not be confined to one device: the
# server gets CUDA_VISIBLE_DEVICES set to the engine's planned GPUs (`miles.ray.placement.check_engine_gpus`).
ENGINE_ACTOR_RUNTIME_ENV = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}


class EngineActorMethods:
    """What an engine's Ray actor answers, delegated to the engine object it holds (`EngineProcess`, or
    `miles.engines.external.ExternalEngine`): the methods the fleet and the health monitor call."""

    engine: EngineProcess

    def launch(self) -> str:
        return self.engine.launch().url

    def url(self) -> str:
        return self.engine.url

    def post(self, path: str, json: object = None, timeout: float = 600.0) -> JSON:
        return self.engine.post(path, json, timeout)

    def get(self, path: str, timeout: float = 60.0) -> JSON:
        return self.engine.get(path, timeout)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def kill(self) -> None:
        self.engine.kill()

    def restart(self) -> str:
        return self.engine.restart().url

    def pid(self) -> int | None:
        return self.engine.pid


@functools.cache
def make_engine_actor_class() -> Any:  # a Ray actor class (ray.remote output): typed by Ray at run time
    """The Ray actor class `RolloutEngineActor` wrapping an `EngineProcess` (imports ray on first call)."""
    import ray

    class RolloutEngineActor(EngineActorMethods):
        """Ray actor holding one engine server process; methods mirror `EngineProcess`. `gpus` is the engine's
        planned GPUs (`miles.ray.placement.EngineGPUs`; None without GPUs), checked before the server starts."""

        def __init__(
            self,
            gpus: EngineGPUs | None = None,
            stacks: tuple[str, str] | None = None,
            **engine_kwargs: Any,  # EngineProcess's arguments
        ):
            if (
                stacks is not None
            ):  # (folder, role): its stacks on SIGUSR1; the server it starts inherits the folder
                from miles.utils import hang_dump

                hang_dump.install(*stacks)
            self.gpus = gpus
            self.engine = EngineProcess(**engine_kwargs)

        def placed_gpus(self) -> list[str]:
            """Check that this engine runs on its planned GPUs and set the server up for them (CUDA_VISIBLE_DEVICES
            and, for SGLang, base_gpu_id 0: SGLang's base_gpu_id indexes the devices the server sees); returns
            the GPUs (Ray's ids) the server's TP ranks will use. PlacementError on a mismatch."""
            if self.gpus is None:
                return []
            from miles.ray.placement import check_engine_gpus

            args = self.engine.sglang_args
            if self.engine.kind == "sglang" and "base-gpu-id" not in args:
                args.setdefault("base_gpu_id", "0")  # the first of the devices the server sees
            env, launched = check_engine_gpus(
                self.gpus,
                self.engine.kind,
                self.engine.sglang_args,
                ray.get_gpu_ids(),
                ray.get_runtime_context().get_node_id(),
                os.environ.get("CUDA_VISIBLE_DEVICES"),
            )
            self.engine.env.update(env)
            return launched

        def launch(self) -> str:
            self.placed_gpus()
            return self.engine.launch().url

    return ray.remote(RolloutEngineActor)
