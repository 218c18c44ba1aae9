"""Who holds the memory when: the offload/onload choreography around training and refit.

Colocated mode alternates one set of devices between the engines and the trainer: the engines release weights and
KV cache before training, the trainer refits the engines' weights and then sleeps, and the engines re-create their
KV cache. Disaggregated mode keeps both resident, so every step here is a no-op except the refit itself.
"""

from __future__ import annotations

from typing import Any


class MemoryChoreography:
    def __init__(self, colocate: bool, train_group: Any, rollout_manager: Any, timeout: float) -> None:
        from miles.ray.utils import ray_get

        self._get = ray_get
        self.colocate = colocate
        self.train_group = train_group
        self.rollout = rollout_manager
        self.timeout = timeout
        self.engine_urls: list[str] = ray_get(
            rollout_manager.get_engine_urls.remote(), timeout, "engine urls"
        )

    def _rollout_call(self, phase: str, method: str, *args: Any) -> None:
        self._get(getattr(self.rollout, method).remote(*args), self.timeout, phase)

    def before_train(self) -> None:
        if self.colocate:
            self._rollout_call("engines release memory", "release_memory", None)
            self.train_group.wake_up()

    def refit(self, weight_version: str) -> None:
        """Push the trainer's weights to the engines and leave the engines ready to generate."""
        if self.colocate:
            self._rollout_call("engines resume weights", "resume_memory", ["weights"])
        self.train_group.update_weights(self.engine_urls, weight_version)
        if self.colocate:
            self.train_group.sleep()
            self._rollout_call("engines resume kv cache", "resume_memory", ["kv_cache", "cuda_graph"])
