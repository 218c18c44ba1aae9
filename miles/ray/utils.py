"""Ray helpers: starting/joining a cluster, and waits that have a deadline and name their phase."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import ray

from miles.utils.hang_dump import expired

logger = logging.getLogger(__name__)


class PhaseTimeoutError(TimeoutError):
    """A blocking wait passed its deadline; the message names the phase it was in."""


def ray_get(refs: Any, timeout: float | None, phase: str, stalled: Callable[[], str] | None = None) -> Any:
    """`ray.get` with a deadline (None: none); also of a `ThreadActor`'s answer (a Future). On expiry raises PhaseTimeoutError naming `phase`, the timeout and
    the stalled component (`stalled()`, e.g. the ranks not done; default: the phase's Ray calls), after every
    miles process dumped its stacks (`miles.utils.hang_dump`: the message names the folder)."""
    if isinstance(refs, Future):  # a `ThreadActor`'s answer
        try:
            return refs.result(timeout=timeout)
        except FutureTimeoutError as e:
            message = f"timed out after {timeout:.0f}s waiting for phase '{phase}'"
            culprit = stalled() if stalled is not None else f"the call(s) of phase '{phase}'"
            raise phase_timeout(message, culprit) from e
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        message = f"timed out after {timeout:.0f}s waiting for phase '{phase}'"
        culprit = stalled() if stalled is not None else f"the Ray call(s) of phase '{phase}'"
        raise phase_timeout(message, culprit) from e


class LocalActor:
    """An object of the driver's own process behind a Ray actor handle's interface: `handle.method.remote(*args)`
    runs the method at once, in the calling thread, and returns an ObjectRef of its result (`ray.put`), so that
    `ray_get` reads it as it reads an actor's answer; an exception is raised by `.remote()` itself. For a helper
    the driver only calls and waits on, where an actor of its own would cost a process (`fleet_in_driver`)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.obj, name)
        return _LocalMethod(method)


class _LocalMethod:
    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return ray.put(self.method(*args, **kwargs))


def local_actor(cls: type, *args: Any, **kwargs: Any) -> LocalActor:
    """`cls(*args, **kwargs)` built in this process, behind a `LocalActor`."""
    return LocalActor(cls(*args, **kwargs))


class ThreadActor:
    """`cls(*args, **kwargs)` built and called on a daemon thread of the driver's process, behind a Ray actor
    handle's interface: `handle.method.remote(*args)` queues the call and returns a `concurrent.futures.Future` of
    its result, which `ray_get` waits on with its deadline as on an actor's answer. As in an actor, the calls run
    one at a time, in order, after the constructor, while the caller goes on (the constructor overlaps what the
    driver starts meanwhile); a constructor's error is raised by every call. Results are the objects themselves,
    not copies. For a helper whose process of its own would cost more than its work in the driver
    (`miles.ray.setup.rollout_in_driver`); `stop` ends the thread."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self._calls: queue.SimpleQueue[tuple[Future, str, tuple, dict] | None] = queue.SimpleQueue()
        self._obj: Any = None
        self._thread = threading.Thread(
            target=self._serve, args=(cls, args, kwargs), name=f"miles-{cls.__name__}", daemon=True
        )
        self._thread.start()

    def _serve(self, cls: type, args: tuple, kwargs: dict) -> None:
        broken: BaseException | None = None
        try:
            self._obj = cls(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every call raises it, as an actor whose constructor failed
            broken = e
        while (call := self._calls.get()) is not None:
            future, name, call_args, call_kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if broken is not None:
                    raise RuntimeError(f"{cls.__name__} failed to start: {broken!r}") from broken
                future.set_result(getattr(self._obj, name)(*call_args, **call_kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's ray_get raises it
                future.set_exception(e)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _QueuedMethod(self._calls, name)

    def stop(self, timeout: float, last: str | None = None) -> None:
        """End the thread after the calls queued (and `last`, a method to call if the object has it); wait for
        it up to `timeout` seconds (a call that hangs is left to the daemon thread)."""
        if last is not None and hasattr(self._obj, last):
            self._calls.put((Future(), last, (), {}))
        self._calls.put(None)
        self._thread.join(timeout)


class _QueuedMethod:
    def __init__(self, calls: queue.SimpleQueue, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self.calls.put((future, self.name, args, kwargs))
        return future


def ready(ref: Any, timeout: float) -> bool:
    """Whether an actor's answer (an ObjectRef, or a `ThreadActor`'s Future) is there, waiting up to `timeout`."""
    if isinstance(ref, Future):
        try:
            ref.exception(timeout=timeout)
        except FutureTimeoutError:
            return False
        return True
    return bool(ray.wait([ref], timeout=timeout)[0])


def phase_timeout(message: str, stalled: str) -> PhaseTimeoutError:
    """The error of a phase past its deadline: `message`, the stalled component and the hang folder."""
    return PhaseTimeoutError(expired(f"{message}; stalled: {stalled}", stalled))


def init_ray(min_cpus: int, env_vars: dict[str, str] | None = None, runtime_envs: bool = True) -> bool:
    """Join the cluster named by RAY_ADDRESS (or a `ray job submit` job), or start one in-process; True when this
    call connected (the caller then owns the connection and calls `ray.shutdown`).

    A local instance gets at least `min_cpus` logical CPUs so that CPU-only runs can place one bundle per worker even
    on a 2-core machine (the workers mostly wait on each other; oversubscription is intended).

    `runtime_envs=False`: the caller's run gives no task or actor a runtime env (e.g. no SGLang engine actor,
    `miles.ray.engine_fleet.engines_may_ask_runtime_env`). A local head then gets no runtime-env agent process
    either (`_lean_head`), unless Ray itself would give the job one (`env_vars`, a `uv run` driver, a runtime env
    hook: `_job_runtime_env_implied`); a runtime env asked for anyway fails at once, naming the cause.

    Ray already initialised in this process (a notebook, a test session running several drivers) is used as it is
    and False is returned: the caller must then release what it created instead of shutting Ray down.
    """
    if ray.is_initialized():
        have = ray.cluster_resources().get("CPU", 0)
        if have < min_cpus:
            raise RuntimeError(
                f"the Ray instance this process already joined has {have:g} CPUs, this run needs {min_cpus}; "
                "call ray.shutdown() first (miles then starts a local instance of the right size)"
            )
        return False
    runtime_env = {"env_vars": dict(env_vars)} if env_vars else None
    if os.environ.get("RAY_ADDRESS"):
        logger.info("joining Ray cluster at %s", os.environ["RAY_ADDRESS"])
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env)
        return True
    num_cpus = max(min_cpus, os.cpu_count() or 1)
    logger.info("starting a local Ray instance with %d logical CPUs, listening on loopback only", num_cpus)
    env_agent = runtime_envs or runtime_env is not None or _job_runtime_env_implied()
    with _loopback_node(), _lean_head(runtime_env_agent=env_agent) as lean:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=True,
            logging_level=logging.WARNING,
            _node_ip_address=LOOPBACK,
        )
    if "start_log_monitor" in lean:
        _forward_worker_logs()
    return True


def _job_runtime_env_implied() -> bool:
    """Whether `ray.init` would give this driver's job a runtime env of its own accord: a job config injected by
    `ray job submit`, a runtime env hook (RAY_RUNTIME_ENV_HOOK) or a driver run by `uv run` (Ray's
    `_maybe_modify_runtime_env`). Unknown (Ray moved these): True."""
    try:
        from ray._private import ray_constants
        from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
        from ray._private.runtime_env.uv_runtime_env_hook import _get_uv_run_cmdline

        if RAY_JOB_CONFIG_JSON_ENV_VAR in os.environ or ray_constants.RAY_RUNTIME_ENV_HOOK in os.environ:
            return True
        return bool(ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV and _get_uv_run_cmdline())
    except (ImportError, AttributeError):
        return True


LOOPBACK = "127.0.0.1"


def cpu_trainer_threads(num_trainers: int, concurrent_engines: int) -> int:
    """Intra-op threads per CPU training rank: the cores this process may use, less one per engine that runs at
    the same time (disaggregated; CPU engines run one thread each), shared by the ranks; at least 1. Ray's own
    default (OMP_NUM_THREADS = the actor's CPU share, at least 1) leaves cores idle when there are fewer ranks than
    cores, e.g. one rank on 2 cores; with as many ranks as cores the two agree."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - concurrent_engines) // max(1, num_trainers))


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Make `ray.init` keep 127.0.0.1 as the node address of a local instance (Ray's servers then listen on
    loopback only; a node address of 127.0.0.1 is what tells them so).

    Ray replaces a loopback `_node_ip_address` with the machine's routable address unless clustering is off
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the setting it uses on laptops). That environment variable is read
    when Ray is imported, so the flag it sets is turned off around the start-up here. A single-node run needs
    nothing reachable from elsewhere; a multi-node cluster is joined through RAY_ADDRESS (`ray start`)."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@contextlib.contextmanager
def _lean_head(runtime_env_agent: bool = True) -> Iterator[list[str]]:
    """Start a local head without the Ray helper processes a single-node run has no use for: the autoscaler
    monitor (the cluster is one fixed node), the API server that `include_dashboard=False` still starts (it then
    loads only Ray's usage-stats module), the log monitor (run on a thread of the driver, `_forward_worker_logs`)
    and Ray's dashboard agent: the raylet needs an agent to start and to persist its ports, and gets
    `agent_stub.py` (`_with_agent_stub`), which persists what the `--minimal` agent does (no metrics agent,
    HTTP or gRPC server; the driver then also skips importing aiohttp, grpc and opentelemetry, `_minimal_agent`).
    Together ~260 MB of PSS, four processes and ~1.5 CPU-s of start-up on the CPU quickstart. With
    `runtime_env_agent=False` (the run asks for no runtime env, `init_ray`) the raylet's runtime-env agent is
    `runtime_env_stub.py` too (~50 MB PSS, ~0.45 CPU-s): the raylet asks that agent only for a task or actor with a
    runtime env, and the stub refuses each such request with an error naming the cause.

    Ray has no ray.init option for these (`ray start --head --no-monitor` is the CLI's), so the head node's start
    methods are skipped while this block runs; a Ray version without one of these hooks starts that process as
    before. Only a cluster miles starts itself is affected: one joined through RAY_ADDRESS is not. Yields the
    start methods skipped."""
    from ray._private import node, services
    from ray._private import utils as ray_utils

    skipped = ["start_monitor", "start_api_server"]
    if _log_monitor_class() is not None:  # the driver runs it on a thread instead (`_forward_worker_logs`)
        skipped.append("start_log_monitor")
    own = {name: node.Node.__dict__[name] for name in skipped if name in node.Node.__dict__}
    for name in own:
        setattr(node.Node, name, _skip_head_process)
    deps_check = getattr(ray_utils, "get_dashboard_dependency_error", None)
    if deps_check is not None:
        ray_utils.get_dashboard_dependency_error = _minimal_agent
    start_process = getattr(services, "start_ray_process", None)
    if start_process is not None:
        services.start_ray_process = _with_agent_stub(start_process, runtime_env_agent)
    try:
        yield list(own)  # the head's start methods skipped
    finally:
        for name, method in own.items():
            setattr(node.Node, name, method)
        if deps_check is not None:
            ray_utils.get_dashboard_dependency_error = deps_check
        if start_process is not None:
            services.start_ray_process = start_process


AGENT_FLAG = "--dashboard_agent_command="
RUNTIME_ENV_AGENT_FLAG = "--runtime_env_agent_command="


def _with_agent_stub(start_process: Callable[..., Any], runtime_env_agent: bool = True) -> Callable[..., Any]:
    """`services.start_ray_process`, but the raylet's dashboard agent is `miles/ray/agent_stub.py` (a bare
    interpreter that persists the ports the minimal agent persists, -1 each, and waits for the raylet) instead of
    Ray's `dashboard/agent.py`, and without `runtime_env_agent` its runtime-env agent is
    `miles/ray/runtime_env_stub.py` instead of Ray's `_private/runtime_env/agent/main.py`. A raylet command without
    that flag or script starts as it is."""
    import ray as ray_pkg

    here = os.path.dirname(os.path.abspath(__file__))
    ray_dir = os.path.dirname(ray_pkg.__file__)
    agent = os.path.join(ray_dir, "dashboard", "agent.py")
    stubs = [(AGENT_FLAG, agent, os.path.join(here, "agent_stub.py"))]
    if not runtime_env_agent:
        env_agent = os.path.join(ray_dir, "_private", "runtime_env", "agent", "main.py")
        stubs.append((RUNTIME_ENV_AGENT_FLAG, env_agent, os.path.join(here, "runtime_env_stub.py")))

    def start(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if process_type == "raylet":
            for flag, script, stub in stubs:
                if os.path.exists(stub) and " " not in stub:
                    # -S: no site-packages (the stubs need the standard library only): 3 MB of PSS instead of 7
                    command = [_swap(a, flag, script, stub) for a in command]
        return start_process(command, process_type, *args, **kwargs)

    return start


def _swap(arg: str, flag: str, script: str, stub: str) -> str:
    """Raylet argument `arg`, with `stub` run by a bare interpreter instead of `script` if `arg` is `flag`'s."""
    return arg.replace(script, f"-S {stub}", 1) if arg.startswith(flag) else arg


def _log_monitor_class() -> type | None:
    """Ray's `LogMonitor` when it has the steps `_forward_worker_logs` runs, else None (its own process stays)."""
    try:
        from ray._private.log_monitor import LogMonitor
    except ImportError:
        return None
    steps = (
        "should_update_filenames",
        "update_log_filenames",
        "open_closed_files",
        "check_log_files_and_publish_updates",
    )
    return LogMonitor if all(hasattr(LogMonitor, s) for s in steps) else None


def _forward_worker_logs() -> None:
    """Ray's log monitor (it tails the workers' output files and publishes new lines; the driver prints them with
    `log_to_driver`) on a daemon thread of the driver instead of a process of its own (~50 MB PSS, ~0.5 CPU-s
    of start-up): the same loop as Ray's, one pass every 0.1 s while nothing new was written. It ends with the
    Ray instance it was started for (`ray.shutdown`). The workers write their log files themselves."""
    import threading

    from ray._private import worker
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    node = worker._global_node
    monitor_cls = _log_monitor_class()
    assert node is not None and monitor_cls is not None
    monitor = monitor_cls(node.node_ip_address, node._logs_dir, GcsClient(address=node.gcs_address), _alive)

    def run() -> None:
        updated = 0.0
        while worker._global_node is node:
            try:
                if monitor.should_update_filenames(updated):  # Ray's back-pressure on globbing many files
                    monitor.update_log_filenames()
                    updated = time.time()
                monitor.open_closed_files()
                published = monitor.check_log_files_and_publish_updates()
            except Exception:  # Ray stopping under it (files moved, GCS gone): the instance's end
                if worker._global_node is node:
                    logger.exception("forwarding the Ray workers' output to the driver failed; it stops")
                return
            if not published:
                time.sleep(0.1)

    threading.Thread(target=run, name="miles-ray-log-monitor", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _skip_head_process(self: Any, **_: Any) -> None:
    """Stands in for a head-node start method whose process a local run does not need."""


def _minimal_agent() -> ImportError:
    """Stands in for Ray's check of its dashboard extras while a local head starts: the answer "missing" starts
    the dashboard agent as `pip install ray` (without `[default]`) would, `--minimal` (no metrics agent, no HTTP
    server, no gRPC server), and spares the driver importing those extras (aiohttp, grpc, opentelemetry)."""
    return ImportError("miles starts a local Ray head with a minimal dashboard agent")


def get_node_ip() -> str:
    return ray.util.get_node_ip_address()
