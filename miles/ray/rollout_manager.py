"""RolloutManager: owns the rollout engines, the router, the prompt data source and the reward functions.

`RolloutManager` is a plain class (the driver wraps it with `ray.remote`); it launches one engine Ray actor per
engine on the placement group, puts sglang-router in front of them, and talks to them over HTTP only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
from pathlib import Path
from typing import Any

import httpx

from miles.ray.placement import Placement
from miles.ray.utils import ray_get
from miles.rollout.generate import SamplingSettings, generate_samples
from miles.utils.types import Sample, SampleStatus

logger = logging.getLogger(__name__)


class RolloutManager:
    def __init__(self, config_dict: dict, placement: Placement, num_rollout_workers: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from miles.config import Config

        self.config = cfg = Config.from_dict(config_dict)
        self.timeout = float(cfg.rollout.rollout_request_timeout)
        self._load_data()
        self._eval_sets: dict[str, Any] = {}  # eval name -> PromptDataset, loaded on first use
        self._start_engines(placement, num_rollout_workers)

    # ----------------------------------------------------------------------------------------------- setup
    def _load_data(self) -> None:
        from transformers import AutoTokenizer

        from miles.rollout.data_source import PromptDataset, RolloutDataSource

        cfg = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        self._dataset_kwargs = dict(
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            metadata_key=cfg.data.metadata_key,
            tokenizer=self.tokenizer,
            apply_chat_template=cfg.data.apply_chat_template,
            max_prompt_len=cfg.rollout.rollout_max_prompt_len,
        )
        dataset = PromptDataset(cfg.data.prompt_data, **self._dataset_kwargs)
        self.data_source = RolloutDataSource(
            dataset,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            shuffle=cfg.data.rollout_shuffle,
            seed=cfg.rollout.rollout_seed,
        )

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

    # ----------------------------------------------------------------------------------------------- rollout
    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def set_start_rollout(self, rollout_id: int) -> None:
        """Position the data cursor for a run resumed at `rollout_id` (one batch of prompts per rollout)."""
        consumed = rollout_id * self.config.rollout.rollout_batch_size
        size = len(self.data_source.dataset)
        self.data_source.load_state_dict({"epoch": consumed // size, "offset": consumed % size})

    def _sampling(self, temperature: float, max_len: int) -> SamplingSettings:
        r = self.config.rollout
        return SamplingSettings(
            temperature=temperature,
            top_p=r.rollout_top_p,
            top_k=r.rollout_top_k,
            max_new_tokens=max_len,
            stop=r.rollout_stop,
            stop_token_ids=r.rollout_stop_token_ids,
            skip_special_tokens=r.rollout_skip_special_tokens,
        )

    def _generate_and_score(self, samples: list[Sample], settings: SamplingSettings) -> int:
        """Generate and score in place; returns the number of samples whose reward function failed.

        (A plain method wrapping a module-level coroutine: an `async def` method would turn this Ray actor into
        an async actor, whose event loop `asyncio.run` cannot nest in.)
        """
        concurrency = self.config.engine.engine_max_running_requests * len(self.engine_urls)
        return asyncio.run(
            _generate_and_score(self.router_url, samples, settings, concurrency, self.timeout, self.config)
        )

    def generate(self, rollout_id: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Generate and score one rollout. Returns the samples (as dicts, prompt groups contiguous) and metrics."""
        r = self.config.rollout
        groups = self.data_source.next_batch(r.rollout_batch_size)
        samples = [s for group in groups for s in group]
        for i, s in enumerate(samples):
            s.index = i
        settings = self._sampling(r.rollout_temperature, r.rollout_max_response_len)
        num_failed = self._generate_and_score(samples, settings)
        metrics = rollout_metrics(samples, num_failed)
        metrics["rollout/dropped_prompts"] = float(self.data_source.dataset.num_filtered)  # too long, at load
        if self.config.log.dump_details:
            _dump_samples(Path(self.config.log.dump_details) / f"rollout_{rollout_id:07d}.jsonl", samples)
        return [s.to_dict() for s in samples], metrics

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Score every eval set once; `eval/<name>` is its mean reward."""
        from miles.rollout.data_source import PromptDataset, RolloutDataSource

        ev, r = self.config.eval, self.config.rollout
        pairs = list(ev.eval_prompt_data or [])
        temperature = ev.eval_temperature if ev.eval_temperature is not None else r.rollout_temperature
        settings = self._sampling(temperature, ev.eval_max_response_len or r.rollout_max_response_len)
        metrics: dict[str, float] = {}
        for name, path in zip(pairs[0::2], pairs[1::2]):
            if name not in self._eval_sets:
                self._eval_sets[name] = PromptDataset(path, **self._dataset_kwargs)
            dataset = self._eval_sets[name]
            source = RolloutDataSource(
                dataset, n_samples_per_prompt=ev.n_samples_per_eval_prompt, shuffle=False, seed=0
            )
            samples = [s for g in source.next_batch(len(dataset)) for s in g]
            self._generate_and_score(samples, settings)
            metrics[f"eval/{name}"] = statistics.fmean(float(s.reward) for s in samples)
            if self.config.log.dump_details:
                _dump_samples(
                    Path(self.config.log.dump_details) / f"eval_{name}_{rollout_id:07d}.jsonl", samples
                )
        return metrics

    # ----------------------------------------------------------------------------------------------- engine control
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


async def _generate_and_score(
    url: str, samples: list[Sample], settings: SamplingSettings, concurrency: int, timeout: float, config: Any
) -> int:
    from miles.rollout.rm_hub import score_samples

    r = config.rollout
    await generate_samples(url, samples, settings, concurrency, timeout)
    scores, num_failed = await score_samples(
        samples, r.rm_type, r.custom_rm_path, config, error_as_zero=r.rm_error_as_zero
    )
    for s, score in zip(samples, scores):
        s.reward = score
    return num_failed


def rollout_metrics(samples: list[Sample], num_failed: int) -> dict[str, float]:
    rewards = [float(s.reward) for s in samples]
    by_group: dict[int, list[float]] = {}
    for s, r in zip(samples, rewards):
        by_group.setdefault(s.group_index, []).append(r)
    flat_groups = sum(1 for g in by_group.values() if len(g) > 1 and max(g) == min(g))
    return {
        "rollout/raw_reward": statistics.fmean(rewards),
        "rollout/response_len": statistics.fmean(s.response_length for s in samples),
        "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        "rollout/aborted_frac": sum(s.status == SampleStatus.ABORTED for s in samples) / len(samples),
        "rollout/reward_failed": float(num_failed),
        "rollout/zero_std_group_frac": flat_groups / max(1, len(by_group)),
    }


def _dump_samples(path: Path, samples: list[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s.to_dict(), default=str) + "\n")
    os.replace(tmp, path)
