"""RolloutManager: the Ray actor body around a `RolloutRunner` (data source, generation, rewards, metrics).

The engines live in a separate actor (`miles.ray.engine_fleet.EngineFleet`); this one only needs their router
and engine URLs. Samples leave it as `Sample` records (Ray pickles them), never as dicts. On the CPU quickstart
with `miles.train` it runs on a thread of the driver's process instead (`miles.ray.setup.rollout_in_driver`).
"""

from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING

from miles.utils.types import Sample

if TYPE_CHECKING:
    from miles.config import Config
    from miles.rollout.async_worker import AsyncGenerationWorker
    from miles.rollout.runner import RolloutState


class RolloutManager:
    """Built in two steps so that its start-up (imports, tokenizer, prompt data) overlaps the trainers' and the
    engines': the constructor needs only the config; `connect` gives it the engines once they answer."""

    # cfg: validated once by the driver; Ray pickles it (secrets included). `in_driver`: built on a thread of the
    # driver's process (`miles.ray.setup.rollout_in_driver`), whose environment, SIGUSR1 handler (its hang dumps
    # cover every thread) and GC freeze (after start-up) are the driver's own: left as they are
    def __init__(self, cfg: Config, in_driver: bool = False) -> None:
        if not in_driver:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from miles.engines.router import generation_via_router
        from miles.rollout.runner import RolloutRunner
        from miles.utils.tokenizer_load import load_tokenizer

        if cfg.log.run_dir and not in_driver:  # its stacks on SIGUSR1, for the driver's hang dumps
            from miles.utils import hang_dump

            hang_dump.install(hang_dump.stacks_dir_of(cfg.log.run_dir), "rollout-manager")
        self.max_running_requests = cfg.engine.engine_max_running_requests
        self.rollout_cfg = cfg.rollout
        self.fault_tolerant = cfg.cluster.use_fault_tolerance  # --fully-async: dead engines skipped by pauses
        self.worker: AsyncGenerationWorker | None = None  # --fully-async
        self.async_state: dict | None = None  # --fully-async: the worker's state from a resumed checkpoint
        self.runner = RolloutRunner(
            cfg.data,
            cfg.rollout,
            cfg.eval,
            tokenizer=load_tokenizer(cfg.model.hf_checkpoint),  # no torch import where it can
            router_url="",  # set by connect()
            engine_urls=[],
            api_key=cfg.engine.engine_api_key,
            concurrency=0,
            dump_dir=cfg.log.dump_details,
            via_router=generation_via_router(
                cfg.router.router_policy, cfg.router.sglang_router_ip is not None
            ),
            lora_adapters=cfg.lora.lora_rank > 0 and cfg.lora.lora_refit == "adapter",
        )
        # what start-up built (modules, tokenizer, the prompt data) lives as long as the process: out of the
        # cyclic GC's reach, a full collection no longer walks it (~140k objects on the quickstart, one full
        # collection every ~20 rollouts, each a stall of tens of ms in the middle of a rollout); in the driver,
        # the driver's own freeze after start-up does it
        if not in_driver:
            gc.freeze()

    def connect(self, router_url: str, engine_urls: list[str]) -> None:
        """The engines (and their router) to generate with: before the first rollout."""
        self.runner.connect(router_url, engine_urls, self.max_running_requests * len(engine_urls))

    def set_start_rollout(self, rollout_id: int) -> None:
        self.runner.set_start_rollout(rollout_id)

    def state_dict(self, after_rollout: int | None = None) -> RolloutState:
        """The data cursor and partial-rollout buffer (as right after `after_rollout`), for the checkpoint;
        under --fully-async the generation worker's state as of now (its data cursor included)."""
        if self.worker is not None:
            worker = self.worker.state_dict()
            return {"data_source": worker.pop("data_source"), "buffer": [], "async_worker": worker}
        return self.runner.state_dict(after_rollout)

    def load_state_dict(self, state: RolloutState) -> None:
        worker = state.get("async_worker")
        pending = len(worker["buffered"]) + len(worker["restart"]) if worker else 0
        if pending and not self.rollout_cfg.fully_async:  # this driver would resume the data cursor alone
            raise RuntimeError(
                f"the checkpoint was saved by --fully-async with {pending} prompt group(s) buffered or in flight; "
                "resume it with --fully-async (python -m miles.train_async) so they are trained, not skipped"
            )
        self.runner.load_state_dict(state)
        self.async_state = worker  # start_async hands it to the worker

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Generate and score one rollout: the samples (prompt groups contiguous) and the metrics."""
        return self.runner.generate(rollout_id)

    def eval(self, rollout_id: int) -> dict[str, float]:
        return self.runner.evaluate(rollout_id)

    # ------------------------------------------------------------------------------------------ --fully-async
    def start_async(self, start_version: int) -> None:
        """Start the persistent generation worker (`miles.rollout.async_worker`); the engines hold weight
        version `start_version`, the first train step's."""
        import math

        from miles.rollout.async_worker import AsyncGenerationWorker, AsyncSettings

        r = self.rollout_cfg
        batch = r.rollout_batch_size
        settings = AsyncSettings(
            batch=batch,
            group_size=r.n_samples_per_prompt,
            max_concurrent_samples=r.async_max_concurrent_samples or batch * r.n_samples_per_prompt,
            capacity=math.floor(r.async_data_buffer_capacity_factor * batch),
            max_staleness=r.max_weight_staleness,
            retry=r.async_unused_samples_handler == "retry",
            fault_tolerant=self.fault_tolerant,
        )
        self.worker = AsyncGenerationWorker(self.runner, settings, start_version)
        if self.async_state is not None:
            self.worker.load_state_dict(self.async_state)
        self.worker.start()

    def take_batch(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """The next batch from the worker's buffer, checked, numbered and scored like `generate`'s."""
        from miles.rollout.base_types import RolloutOutput

        assert self.worker is not None, "start_async first"
        groups, metrics = self.worker.take_batch(rollout_id, timeout=None)
        return self.runner.finish_rollout(RolloutOutput(groups=groups, metrics=metrics), rollout_id)

    def pause_generation(self, mode: str) -> None:
        assert self.worker is not None, "start_async first"
        self.worker.pause(mode, float(self.rollout_cfg.rollout_request_timeout))

    def continue_generation(self, version: int) -> None:
        assert self.worker is not None, "start_async first"
        self.worker.resume(version, float(self.rollout_cfg.rollout_request_timeout))

    def close(self) -> None:
        """Stop the generation worker and close the generate client and its event loop (in the driver's process
        they would outlive the run; an actor's go with its process)."""
        self.stop_async()
        self.runner.close()

    def stop_async(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
