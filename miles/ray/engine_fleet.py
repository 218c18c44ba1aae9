"""EngineFleet: the rollout engines (one Ray actor each), sglang-router in front of them, and engine control.

`EngineFleet` is a plain class (the driver wraps it with `ray.remote`): it launches one engine Ray actor per
engine on the placement group, puts sglang-router in front of them, and controls them over HTTP (memory
release/resume, cache flush). Generation does not go through it: the rollout runner talks to the router.
"""

from __future__ import annotations

import logging
import os

import httpx

from miles.ray.placement import Placement
from miles.ray.utils import ray_get

logger = logging.getLogger(__name__)


class EngineFleet:
    def __init__(self, config_dict: dict, placement: Placement, num_rollout_workers: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from miles.config import Config

        self.config = Config.from_dict(config_dict)
        self.timeout = float(self.config.rollout.rollout_request_timeout)
        self._start_engines(placement, num_rollout_workers)

    def _start_engines(self, placement: Placement, num_rollout_workers: int) -> None:
        from miles.engines.router import Router
        from miles.engines.sglang_engine import (
            ENGINE_ACTOR_RUNTIME_ENV,
            engine_launch_kwargs,
            make_engine_actor_class,
            resolve_engine_kind,
        )

        cfg = self.config
        kind = resolve_engine_kind(cfg.rollout.rollout_engine)
        per_engine = int(cfg.cluster.rollout_num_gpus_per_engine)
        num_engines = max(1, num_rollout_workers // per_engine)
        actor_cls = make_engine_actor_class()
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
            )  # fmt: skip
            self.engines.append(
                actor_cls.options(
                    **placement.engine_options(i, per_engine),
                    **({"runtime_env": ENGINE_ACTOR_RUNTIME_ENV} if kind == "sglang" else {}),
                ).remote(
                    model_path=cfg.model.hf_checkpoint,
                    kind=kind,
                    host=cfg.engine.engine_host,
                    tp_size=per_engine,
                    admin_api_key=cfg.engine.engine_api_key,
                    startup_timeout=self.timeout,
                    **launch,
                )
            )
        self.engine_urls: list[str] = ray_get(
            [e.launch.remote() for e in self.engines],
            self.timeout,
            f"starting {num_engines} {kind} engine(s)",
        )
        self.router = Router(self.engine_urls, startup_timeout=self.timeout).launch()
        self.router_url = self.router.url
        logger.info("engines %s behind router %s", self.engine_urls, self.router_url)

    # ----------------------------------------------------------------------------------------------- queries
    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def get_router_url(self) -> str:
        return self.router_url

    # ----------------------------------------------------------------------------------------------- control
    def _post_all(self, path: str, body: dict | None = None) -> None:
        headers = {}
        if self.config.engine.engine_api_key:
            headers["Authorization"] = f"Bearer {self.config.engine.engine_api_key}"
        with httpx.Client(timeout=self.timeout, headers=headers) as client:
            for url in self.engine_urls:
                try:
                    resp = client.post(f"{url}{path}", json=body or {})
                except httpx.TimeoutException as e:
                    raise TimeoutError(
                        f"engine control: {url}{path} gave no answer within {self.timeout:.0f}s"
                    ) from e
                if resp.status_code != 200:
                    raise RuntimeError(
                        f"engine control: {url}{path} answered {resp.status_code}: {resp.text[:500]}"
                    )

    def release_memory(self, tags: list[str] | None = None) -> None:
        self._post_all("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._post_all("/resume_memory_occupation", {"tags": tags})

    def flush_cache(self) -> None:
        self._post_all("/flush_cache")

    def shutdown(self) -> None:
        self.router.shutdown()
        ray_get([e.shutdown.remote() for e in self.engines], 60, "stopping engines")
