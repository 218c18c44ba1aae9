"""EngineFleet: the rollout engines (one Ray actor each), sglang-router in front of them, and their health.

`EngineFleet` is a plain class (the driver wraps it with `ray.remote`): it launches one engine Ray actor per
engine on the placement group (or, with `--rollout-external-engine-addrs`, one `ExternalEngine` actor per running
engine, which it neither starts nor stops), puts sglang-router in front of them (or registers them with the
running one of `--sglang-router-ip/--sglang-router-port`) when the run needs a router (`router_needed`). Memory release/resume is posted by the driver itself
(`miles.utils.engine_control_http.EngineMemoryControl`), not through this actor.
Generation does not go through it either: the rollout runner's generate client sends requests to the engines
directly, reading the router's worker list to learn which engines are admitted, or through the router (see
`miles.engines.router.generation_via_router`).
Engines get their GPUs from the placement's sorted bundle order (`Placement.engine_gpus`); each checks them at start.
With `--use-fault-tolerance` it runs a `HealthMonitor` while rollouts run (see `miles.ray.engine_health`); an
external engine that fails its health check is taken out of the router and fails the run, named as external.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from miles.ray.engine_health import HealthMonitor, HealthSettings
from miles.ray.placement import Placement
from miles.ray.utils import ray_get
from miles.utils import hang_dump
from miles.utils.engine_control_http import health_problem, launch_keys

if TYPE_CHECKING:
    from miles.config import Config
    from miles.engines.router import Router

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


class EngineFleet:
    def __init__(self, config: Config, placement: Placement | None, num_rollout_workers: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.config = config  # validated once by the driver; Ray pickles it (secrets included)
        if self.config.log.run_dir:  # its stacks on SIGUSR1, for the driver's hang dumps
            hang_dump.install(hang_dump.stacks_dir_of(self.config.log.run_dir), "engine-fleet")
        self.timeout = float(self.config.rollout.rollout_request_timeout)
        # loading a model is not a request: engine (re)starts wait as long as any other Ray call may take
        self.startup_timeout = float(self.config.train.train_timeout)
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

    def _start_engines(self, placement: Placement | None, num_rollout_workers: int) -> None:
        cfg = self.config
        log_dir = os.path.abspath(os.path.join(cfg.log.run_dir, "logs"))
        os.makedirs(log_dir, exist_ok=True)
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
            engine_launch_kwargs,
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
        local_args = {
            "max-running-requests": cfg.engine.engine_max_running_requests,
            "request-timeout": self.timeout,
            # CPU engines share the machine with the trainer: one intra-op thread each avoids oversubscription
            "num-threads": 1 if not placement.use_gpu else None,
        }
        self.engines = []
        for i in range(num_engines):
            launch = engine_launch_kwargs(
                kind, i, cfg.rollout.rollout_seed, cfg.cluster.colocate, dict(cfg.engine.sglang_args),
                {k: v for k, v in local_args.items() if v is not None},
                return_routed_experts=cfg.rollout.use_rollout_routing_replay,
            )  # fmt: skip
            self.engines.append(
                actor_cls.options(
                    **placement.engine_options(i, per_engine),
                    **({"runtime_env": ENGINE_ACTOR_RUNTIME_ENV} if kind == "sglang" else {}),
                ).remote(
                    gpus=plan[i] if plan is not None else None,
                    model_path=cfg.model.hf_checkpoint,
                    kind=kind,
                    host=cfg.engine.engine_host,
                    tp_size=per_engine,
                    **launch_keys(cfg.engine.engine_api_key),
                    startup_timeout=self.startup_timeout,
                    log_path=os.path.join(log_dir, f"engine_{i}.log"),
                    stacks=(hang_dump.stacks_dir_of(cfg.log.run_dir), f"engine{i}-actor"),
                    **launch,
                )
            )
        self.engine_urls: list[str] = ray_get(
            [e.launch.remote() for e in self.engines],
            self.startup_timeout,
            f"starting {num_engines} {kind} engine(s)",
        )

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
        ray_get([e.shutdown.remote() for e in self.engines], 60, "stopping engines")

    def kill(self) -> None:
        """Fast teardown (Ctrl-C): SIGKILL every engine and the router."""
        if self.monitor is not None:
            self.monitor.close()
        if self.router is not None:
            self.router.shutdown(timeout=2)
        ray_get([e.kill.remote() for e in self.engines], 10, "killing engines")
