"""EngineFleet: the rollout engines (one Ray actor each), sglang-router in front of them, and their health.

`EngineFleet` is a plain class (the driver wraps it with `ray.remote`): it launches one engine Ray actor per
engine on the placement group (or, with `--rollout-external-engine-addrs`, one `ExternalEngine` actor per running
engine, which it neither starts nor stops), puts sglang-router in front of them (or registers them with the
running one of `--sglang-router-ip/--sglang-router-port`) when the run needs a router (`router_needed`). On a
colocated CPU run with the embedded engine (`engines_in_trainers`) it launches no engine actor: once the training
ranks are up, `host_engines` has rank i serve engine i from threads of its own process (same HTTP API, own port).
Memory release/resume is posted by the driver itself
(`miles.utils.engine_control_http.EngineMemoryControl`), not through this actor.
Generation does not go through it either: the rollout runner's generate client sends requests to the engines
directly, reading the router's worker list to learn which engines are admitted, or through the router (see
`miles.engines.router.generation_via_router`).
Where it would only start and stop engines inside the ranks, it runs in the driver's process (`fleet_in_driver`).
Engines get their GPUs from the placement's sorted bundle order (`Placement.engine_gpus`); each checks them at start.
With `--use-fault-tolerance` it runs a `HealthMonitor` while rollouts run (see `miles.ray.engine_health`); an
external engine that fails its health check is taken out of the router and fails the run, named as external.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from miles.ray.engine_health import HealthMonitor, HealthSettings
from miles.ray.placement import Placement
from miles.ray.utils import ray_get
from miles.utils import hang_dump
from miles.utils.engine_control_http import health_problem, launch_keys

if TYPE_CHECKING:
    from miles.config import Config
    from miles.engines.router import Router
    from miles.utils.types import ActorHandle

logger = logging.getLogger(__name__)


def router_needed(config: Config) -> bool:
    """Whether the run needs sglang-router: generation goes through it (`--router-policy`, a running router), the
    health monitor keeps its worker list (`--use-fault-tolerance`), or router options were given. Otherwise the
    generate client routes by itself and no router process is started (one process and ~60 MB less)."""
    r = config.router
    return (
        r.router_policy is not None
        or r.sglang_router_ip is not None
        or bool(r.router_args)
        or bool(config.cluster.use_fault_tolerance)
    )


def engines_in_trainers(config: Config, use_gpu: bool) -> bool:
    """Whether the embedded engines run inside the training ranks' processes (`--cpu-engine-in-trainer`, on by
    default), engine i in rank i's: on CPU, colocated (engine and rank take turns, so they never compute at the
    same time), with the embedded engine (`--rollout-engine` auto or local), one CPU worker per engine, no more
    engines than ranks, in a training run. Never with `--use-fault-tolerance` (restarting an engine must not take
    its trainer down), external engines, GPUs, SGLang or disaggregated engines: each engine then is a process of
    its own behind its own Ray actor, as before."""
    c = config.cluster
    num_engines = c.rollout_num_gpus if c.rollout_num_gpus is not None else c.actor_world_size
    return (
        bool(c.cpu_engine_in_trainer)
        and not use_gpu
        and bool(c.colocate)
        and not c.rollout_external
        and not c.use_fault_tolerance
        and config.rollout.rollout_engine in ("auto", "local")
        and int(c.rollout_num_gpus_per_engine) == 1
        and num_engines <= c.actor_world_size
        and not config.debug.debug_rollout_only
        and config.debug.load_debug_rollout_data is None
    )


def engines_may_ask_runtime_env(config: Config) -> bool:
    """Whether the run may start an SGLang engine actor, the only actor miles gives a runtime env
    (`ENGINE_ACTOR_RUNTIME_ENV`): not with external engines or `--rollout-engine local`; with `auto`, whenever
    sglang is installed (it picks SGLang where there are GPUs, which are known only once Ray runs). Without one
    a local Ray head needs no runtime-env agent (`miles.ray.utils.init_ray`)."""
    if config.cluster.rollout_external or config.rollout.rollout_engine == "local":
        return False
    if config.rollout.rollout_engine == "sglang":
        return True
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def fleet_in_driver(config: Config, placement: Placement | None) -> bool:
    """Whether the fleet runs in the driver's process instead of a Ray actor of its own (~70 MB PSS and ~0.8 CPU-s
    of start-up less): when all it does is start the engines inside the training ranks (`engines_in_trainers`),
    hand out their URLs and stop them, with no router process (`router_needed`) and no health monitor. The
    driver calls it through the same `.method.remote()` interface (`miles.ray.utils.LocalActor`)."""
    return (
        placement is not None and engines_in_trainers(config, placement.use_gpu) and not router_needed(config)
    )


class EngineFleet:
    def __init__(
        self,
        config: Config,
        placement: Placement | None,
        num_rollout_workers: int,
        in_driver: bool = False,
    ) -> None:
        self.config = config  # validated once by the driver; Ray pickles it (secrets included)
        if not in_driver:  # a process of its own (`fleet_in_driver`: the driver's stacks are dumped anyway)
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            if self.config.log.run_dir:  # its stacks on SIGUSR1, for the driver's hang dumps
                hang_dump.install(hang_dump.stacks_dir_of(self.config.log.run_dir), "engine-fleet")
        self.timeout = float(self.config.rollout.rollout_request_timeout)
        # loading a model is not a request: engine (re)starts wait as long as any other Ray call may take
        self.startup_timeout = float(self.config.train.train_timeout)
        self.engines: list[ActorHandle] = []  # one Ray actor per engine of its own process
        self.hosts: list[ActorHandle] = []  # the training ranks whose processes serve the engines
        self.engine_urls: list[str] = []
        # the embedded engines run inside the training ranks: `host_engines` starts them once the ranks are up
        self.num_hosted = 0
        if placement is not None and engines_in_trainers(config, placement.use_gpu):
            self.num_hosted = max(1, num_rollout_workers)
        else:
            self._start_engines(placement, num_rollout_workers)
        self.monitor: HealthMonitor | None = None
        c = self.config.cluster
        if c.use_fault_tolerance:
            settings = HealthSettings(
                c.rollout_health_check_interval,
                c.rollout_health_check_timeout,
                c.rollout_health_check_first_wait,
            )
            self.monitor = HealthMonitor(
                self.engine_urls, settings, self._check_health, self._take_out, self._restart
            )

    def _log_dir(self) -> str:
        log_dir = os.path.abspath(os.path.join(self.config.log.run_dir, "logs"))
        os.makedirs(log_dir, exist_ok=True)
        return log_dir

    def _start_engines(self, placement: Placement | None, num_rollout_workers: int) -> None:
        cfg = self.config
        log_dir = self._log_dir()
        if cfg.cluster.rollout_external:
            self._use_external_engines()
        else:
            assert placement is not None, "launched engines need a placement"
            self._launch_engines(placement, num_rollout_workers, log_dir)
        self._start_router(log_dir)

    def _use_external_engines(self) -> None:
        from miles.engines.external import engine_url, make_external_engine_actor_class

        addrs = self.config.cluster.rollout_external_engine_addrs or []
        actor_cls = make_external_engine_actor_class()
        self.engines = [
            actor_cls.options(num_cpus=0).remote(
                url=engine_url(a),
                admin_api_key=self.config.engine.engine_api_key,
                startup_timeout=self.startup_timeout,
            )
            for a in addrs
        ]
        self.engine_urls = ray_get(
            [e.launch.remote() for e in self.engines],
            self.startup_timeout,
            f"waiting for {len(addrs)} external engine(s) {list(addrs)}",
        )

    def _start_router(self, log_dir: str) -> None:
        from miles.engines.router import DEFAULT_POLICY, Router, merge_args, resilience_args
        from miles.engines.router_args import router_command_args

        r = self.config.router
        self.router: Router | None = None
        if not router_needed(self.config):  # generation goes straight to the engines: no router process
            # a router URL that is an engine's: the client reads no worker list (every engine is admitted)
            self.router_url = self.engine_urls[0]
            logger.info("engines %s, no router (generation goes straight to them)", self.engine_urls)
            return
        if r.sglang_router_ip is not None:
            assert r.sglang_router_port is not None  # validated together
            self.router = Router.running_at(
                r.sglang_router_ip,
                r.sglang_router_port,
                self.startup_timeout,
                self.config.engine.engine_api_key,
            )
            self.router.register(self.engine_urls, self.startup_timeout)
        else:
            self.router = Router(
                self.engine_urls,
                policy=r.router_policy or DEFAULT_POLICY,
                startup_timeout=self.startup_timeout,
                extra_args=merge_args(
                    resilience_args(self.timeout), router_command_args(dict(r.router_args))
                ),
                log_path=os.path.join(log_dir, "router.log"),
                worker_api_key=self.config.engine.engine_api_key,
            ).launch()
        self.router_url = self.router.url
        logger.info("engines %s behind router %s", self.engine_urls, self.router_url)

    def _launch_engines(self, placement: Placement, num_rollout_workers: int, log_dir: str) -> None:
        from miles.engines.sglang_engine import (
            ENGINE_ACTOR_RUNTIME_ENV,
            make_engine_actor_class,
            resolve_engine_kind,
        )

        cfg = self.config
        kind = resolve_engine_kind(cfg.rollout.rollout_engine, gpu=placement.use_gpu)  # not torch's answer
        per_engine = int(cfg.cluster.rollout_num_gpus_per_engine)
        num_engines = max(1, num_rollout_workers // per_engine)
        actor_cls = make_engine_actor_class()
        # each engine's GPUs by sorted (node, GPU id), checked here (one node per engine, no GPU shared, colocated:
        # the GPUs of its training ranks) and again by the engine at start against what Ray gave it
        plan = placement.engine_gpus(per_engine)
        for gpus in plan or []:
            logger.info("%s: GPUs %s", gpus.describe(), list(gpus.gpu_ids))
        self.engines = []
        for i in range(num_engines):
            self.engines.append(
                actor_cls.options(
                    **placement.engine_options(i, per_engine),
                    **({"runtime_env": ENGINE_ACTOR_RUNTIME_ENV} if kind == "sglang" else {}),
                ).remote(
                    gpus=plan[i] if plan is not None else None,
                    kind=kind,
                    tp_size=per_engine,
                    stacks=(hang_dump.stacks_dir_of(cfg.log.run_dir), f"engine{i}-actor"),
                    **self._engine_kwargs(kind, i, placement.use_gpu, log_dir),
                )
            )
        self.engine_urls = ray_get(
            [e.launch.remote() for e in self.engines],
            self.startup_timeout,
            f"starting {num_engines} {kind} engine(s)",
        )

    def _engine_kwargs(self, kind: str, index: int, use_gpu: bool, log_dir: str) -> dict[str, Any]:
        """Engine `index`'s server arguments (`EngineProcess`'s, less kind, tp_size and python): the model, the
        address, the keys, the deadline, the log and the flags (`engine_launch_kwargs`)."""
        from miles.engines.sglang_engine import engine_launch_kwargs

        cfg = self.config
        local_args = {
            "max-running-requests": cfg.engine.engine_max_running_requests,
            "request-timeout": self.timeout,
            # CPU engines share the machine with the trainer: one intra-op thread each avoids oversubscription
            "num-threads": 1 if not use_gpu else None,
        }
        launch = engine_launch_kwargs(
            kind, index, cfg.rollout.rollout_seed, cfg.cluster.colocate, dict(cfg.engine.sglang_args),
            {k: v for k, v in local_args.items() if v is not None},
            return_routed_experts=cfg.rollout.use_rollout_routing_replay,
        )  # fmt: skip
        return {
            "model_path": cfg.model.hf_checkpoint,
            "host": cfg.engine.engine_host,
            **launch_keys(cfg.engine.engine_api_key),
            "startup_timeout": self.startup_timeout,
            "log_path": os.path.join(log_dir, f"engine_{index}.log"),
            **launch,
        }

    def host_engines(self, ranks: list[ActorHandle]) -> None:
        """`engines_in_trainers`: start engine i inside training rank i's process (`TrainWorker.launch_engine`,
        the rank on engine i's bundle), then the router if the run needs one; called once, after the ranks'
        init. The engines speak the same HTTP API on their own ports as engines of their own process do."""
        if self.engine_urls:
            raise RuntimeError(f"engines already started: {self.engine_urls}")
        if len(ranks) < self.num_hosted:
            raise ValueError(f"{self.num_hosted} engine(s) to host but only {len(ranks)} training rank(s)")
        log_dir = self._log_dir()
        self.hosts = list(ranks[: self.num_hosted])
        calls = []
        for i, rank in enumerate(self.hosts):
            kwargs = self._engine_kwargs("local", i, False, log_dir)
            kwargs.pop("sglang_args"), kwargs.pop("env")  # the embedded engine's flags are `local_args`
            # the start-up releases it and refits it from the rank's own weights: it reads no checkpoint
            kwargs["local_args"] = {**kwargs["local_args"], "start-released": True}
            calls.append(rank.launch_engine.remote(kwargs))
        self.engine_urls = ray_get(
            calls, self.startup_timeout, f"starting {len(calls)} embedded engine(s) inside the training ranks"
        )
        logger.info("engines %s run inside training ranks 0..%d", self.engine_urls, len(calls) - 1)
        self._start_router(log_dir)

    # ----------------------------------------------------------------------------------------------- queries
    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def get_router_url(self) -> str:
        return self.router_url

    # ----------------------------------------------------------------------------------------------- health
    def _check_health(self, url: str, timeout: float) -> str | None:
        return health_problem(url, "/health_generate", timeout)

    def _take_out(self, url: str) -> None:
        assert self.router is not None  # fault tolerance always has one (`router_needed`)
        if url in self.router.list_workers():
            self.router.remove_worker(url)

    def _restart(self, url: str) -> None:
        engine = self.engines[self.engine_urls.index(url)]
        new_url = ray_get(engine.restart.remote(), self.startup_timeout, f"restarting engine {url}")
        assert new_url == url, (new_url, url)

    def start_watch(self) -> None:
        """A rollout starts: check engine health (no-op without --use-fault-tolerance)."""
        if self.monitor is not None:
            self.monitor.start_watch()

    def take_restarted(self) -> list[str]:
        """Engines restarted since the last call; they need a refit, then `readmit`."""
        return self.monitor.take_restarted() if self.monitor is not None else []

    def stop_watch(self) -> list[str]:
        """The rollout ended: stop checking, wait for a restart in progress; returns the engines to refit."""
        return self.monitor.stop_watch(self.startup_timeout) if self.monitor is not None else []

    def recover_dead(self) -> list[str]:
        """Engines paused for a refit: restart those that do not answer `/health` now (paused engines cannot
        answer /health_generate); returns the engines to refit (restarted since the last call)."""
        if self.monitor is None:
            return []
        return self.monitor.recover_now(lambda url, timeout: health_problem(url, "/health", timeout))

    def readmit(self, urls: list[str]) -> None:
        """Put refit engines back behind the router."""
        for url in urls:
            if self.router is not None:
                self.router.add_worker(url)
            if self.monitor is not None:
                self.monitor.done(url)

    def recoveries(self) -> int:
        """How many engine restarts the health monitor made."""
        return len(self.monitor.recoveries) if self.monitor is not None else 0

    def shutdown(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.router is not None:
            self.router.shutdown()
        ray_get(
            [e.shutdown.remote() for e in self.engines] + [r.shutdown_engine.remote() for r in self.hosts],
            60,
            "stopping engines",
        )

    def kill(self) -> None:
        """Fast teardown (Ctrl-C): SIGKILL every engine and the router."""
        if self.monitor is not None:
            self.monitor.close()
        if self.router is not None:
            self.router.shutdown(timeout=2)
        # engines inside training ranks go with their processes (the ranks may be busy: no call to them here)
        ray_get([e.kill.remote() for e in self.engines], 10, "killing engines")
