"""RayTrainGroup: one Ray actor per training process, fanning each call out to all of them.

The actor is thin: it exports the process-group environment and delegates to the backend class registered under
`--train-backend` (see miles/backends/base.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import ray

from miles.ray.colocate import REFIT_SECONDS, RefitAfterTrain
from miles.ray.placement import Placement
from miles.ray.utils import get_node_ip, ray_get
from miles.utils.net import free_port
from miles.utils.parallel_dims import ParallelDims
from miles.utils.types import JSON, Sample

if TYPE_CHECKING:
    from miles.backends.base import PolicyBackend, ValueBackend, ValueTrainResult
    from miles.config import Config
    from miles.engines.local.in_process import InProcessEngine
    from miles.utils.engine_control_http import EngineMemoryControl

# the critic's values of one rank's samples: one list of floats per sample (per response token)
SampleValues: TypeAlias = list[list[float]]
T = TypeVar("T")


class RefitAfterTrainError(RuntimeError):
    """The refit at the end of a train call failed (training itself succeeded): names the phase, the weight
    version and the cause (the engine, endpoint and what went wrong)."""


class TrainWorker:
    """Body of the training Ray actor (wrapped with ray.remote in RayTrainGroup)."""

    def __init__(self, config: Config, rank: int, world_size: int, env_vars: dict[str, str]) -> None:
        os.environ.update(env_vars)
        if "OMP_NUM_THREADS" in env_vars and "torch" in sys.modules:  # else torch reads it when imported
            sys.modules["torch"].set_num_threads(int(env_vars["OMP_NUM_THREADS"]))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.config = config  # validated once by the driver; Ray pickles it (secrets included)
        self.rank = rank
        self.world_size = world_size
        self.backend: PolicyBackend | ValueBackend | None = None  # by the role `init` was given
        self.engine: InProcessEngine | None = None  # an embedded engine this process serves (`launch_engine`)
        self._engine_control: EngineMemoryControl | None = None  # its memory control (`release_own_engine`)

    def launch_engine(self, engine_kwargs: dict[str, Any]) -> str:
        """Serve an embedded engine from threads of this process (`miles.engines.local.in_process`; the fleet's
        `host_engines`, CPU colocated runs only); returns its URL. Its intra-op threads are its own (its
        `--num-threads`): this rank's stay as they are."""
        from miles.engines.local.in_process import InProcessEngine

        if self.engine is not None:
            raise RuntimeError(
                f"training worker rank {self.rank}: already serves an engine at {self.engine.url}"
            )
        self.engine = InProcessEngine(**engine_kwargs)
        return self.engine.launch().url

    def shutdown_engine(self) -> None:
        """Stop the engine this process serves (no-op without one)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def master_address(self) -> tuple[str, int]:
        return get_node_ip(), free_port("")

    def init(self, master_addr: str, master_port: int, role: str, with_ref: bool) -> int:
        os.environ.update(
            {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0",  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            }
        )
        from miles.backends import get_policy_class, get_value_class
        from miles.utils import hang_dump

        if self.config.log.run_dir:  # its stacks on SIGUSR1, for the driver's hang dumps
            hang_dump.install(
                hang_dump.stacks_dir_of(self.config.log.run_dir), f"trainer-{role}-rank{self.rank}"
            )
        name = self.config.train.train_backend
        cls = get_value_class(name) if role == "critic" else get_policy_class(name)
        self.backend = cls(self.config, self.rank, self.world_size)
        return self.backend.init(role, with_ref)

    @property
    def _backend(self) -> PolicyBackend | ValueBackend:
        if self.backend is None:
            raise RuntimeError(f"training worker rank {self.rank}: called before init()")
        return self.backend

    @property
    def _policy(self) -> PolicyBackend:
        from miles.backends.base import ValueBackend

        backend = self._backend
        if isinstance(backend, ValueBackend):
            raise RuntimeError(
                f"training worker rank {self.rank}: the critic role trains with train_values()"
            )
        return backend

    @property
    def _value(self) -> ValueBackend:
        from miles.backends.base import ValueBackend

        backend = self._backend
        if not isinstance(backend, ValueBackend):
            raise RuntimeError(f"training worker rank {self.rank}: the actor role trains with train()")
        return backend

    def train(
        self,
        rollout_id: int,
        samples: list[Sample],
        values: SampleValues | None = None,
        refit: RefitAfterTrain | None = None,
        release: list[str] | None = None,
    ) -> dict[str, float]:
        """Train the policy on this rank's samples; with `release`, first the engine this process serves releases
        those memory tags (`release_own_engine`); with `refit`, then refit the engines in the same call (its
        seconds under `REFIT_SECONDS`, its `perf/refit_*` beside them; a failure there raises
        `RefitAfterTrainError`)."""
        backend = self._policy
        if release:
            self.release_own_engine(release)
        metrics = (
            backend.train(rollout_id, samples)
            if values is None
            else backend.train(rollout_id, samples, values)
        )
        if refit is None:
            return metrics
        start = time.perf_counter()
        try:
            refit_metrics = backend.update_weights(
                refit.engine_urls, refit.weight_version, resume_tags=refit.resume_tags
            )
        except Exception as e:  # noqa: BLE001 - re-raised naming the phase; the cause stays attached
            raise RefitAfterTrainError(
                f"training rank {self.rank}: phase 'refit' (weight version {refit.weight_version}, run at the end "
                f"of the train call of rollout {rollout_id}, after training succeeded): {type(e).__name__}: {e}"
            ) from e
        return {**metrics, **(refit_metrics or {}), REFIT_SECONDS: time.perf_counter() - start}

    def release_own_engine(self, tags: list[str]) -> None:
        """The engine this process serves (if any) releases `tags`: called on its scheduler thread directly (no
        HTTP round trip), and when it refuses as busy, over its loopback port (`EngineMemoryControl`, which
        waits for idle); then every rank learns whether any failed and all raise together, before any of them
        trains (a collective over the training ranks: one flag all-reduced)."""
        import torch.distributed as dist

        from miles.engines.local.control import RefitRefused
        from miles.refit.session import raise_if_any_failed
        from miles.utils.engine_control_http import EngineMemoryControl

        error = None
        if self.engine is not None:
            timeout = float(self.config.rollout.rollout_request_timeout)
            try:
                try:
                    self.engine.release_memory(tags, timeout)
                except RefitRefused:  # busy (requests still finishing): wait for idle, then release
                    control = self._engine_control
                    if control is None or control.engine_urls != [self.engine.url]:  # it asks the kind once
                        control = EngineMemoryControl(
                            [self.engine.url], self.config.engine.engine_api_key, timeout
                        )
                        self._engine_control = control
                    control.release_memory(tags)
            except Exception as e:  # noqa: BLE001 - raised on every rank below, so none trains alone
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
        group = dist.group.WORLD if self.world_size > 1 else None
        raise_if_any_failed(error, self.world_size, group, f"engine release before train failed ({tags})")

    def train_values(self, rollout_id: int, samples: list[Sample]) -> ValueTrainResult:
        """Train the value model on this rank's samples: its metrics and the values GAE used."""
        return self._value.train(rollout_id, samples)

    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        self._backend.save(rollout_id, extra_state)

    def resume_state(self) -> dict[str, JSON]:
        return self._backend.resume_state()

    def save_hf(self, rollout_id: int) -> None:
        self._policy.save_hf(rollout_id)

    def sleep(self) -> None:
        self._backend.sleep()

    def wake_up(self) -> None:
        self._backend.wake_up()

    def update_weights(
        self, engine_urls: list[str], weight_version: str, flush_cache: bool = True
    ) -> dict[str, float]:
        return self._policy.update_weights(engine_urls, weight_version, flush_cache=flush_cache)


class RayTrainGroup:
    """Creates `num_workers` training actors on the placement and fans calls out to all of them."""

    def __init__(
        self,
        config: Config,
        placement: Placement,
        num_workers: int,
        env_vars: dict[str, str],
        role: str = "actor",
    ) -> None:
        self.config = config
        self.role = role
        self.timeout = float(config.train.train_timeout)
        self.num_workers = num_workers
        self.dims = ParallelDims(
            num_workers,
            int(config.train.context_parallel_size),
            int(config.train.tensor_model_parallel_size),
        )
        self.cp_size = self.dims.cp_size
        remote_cls = ray.remote(TrainWorker)
        self.workers = [
            remote_cls.options(**placement.worker_options(role, rank)).remote(
                config, rank, num_workers, env_vars
            )
            for rank in range(num_workers)
        ]

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    def _all(self, phase: str, method: str, *args: object) -> list[Any]:
        return self._gather([getattr(w, method).remote(*args) for w in self.workers], phase)

    def _gather(self, refs: Sequence[ray.ObjectRef], phase: str) -> list[Any]:
        """Wait for one call per rank; a dead worker is named by its rank and the phase, a deadline by the ranks
        that had not answered. The answers are what the workers' methods return (Ray does not type them)."""

        def late() -> str:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            return f"training ranks not done: {[rank for rank, ref in enumerate(refs) if ref not in ready]}"

        try:
            return ray_get(refs, self.timeout, phase, stalled=late)
        except ray.exceptions.RayActorError as e:
            for rank, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as err:
                    raise RuntimeError(
                        f"training worker rank {rank} died in phase '{phase}': {str(err).splitlines()[0]}"
                    ) from e
                except Exception:  # noqa: BLE001 - not ready, or failed otherwise: look at the next rank
                    continue
            raise

    def init(self, with_ref: bool) -> int:
        addr, port = ray_get(
            self.workers[0].master_address.remote(), self.timeout, "train init: master address"
        )
        starts: list[int] = self._all(f"{self.role} init", "init", addr, port, self.role, with_ref)
        if len(set(starts)) != 1:
            raise RuntimeError(f"training ranks disagree on the resume rollout id: {starts}")
        return starts[0]

    def _shared(self, per_dp: Sequence[T]) -> list[ray.ObjectRef | T]:
        """Each DP rank's argument as the train calls take it: stored once (`ray.put`) when the CP ranks of a DP
        rank share it, else passed as it is (Ray sends a small argument inside the call, ~2.5 ms less per step
        on the quickstart than a put, and stores a large one by itself)."""
        if self.dims.replica_size == 1:
            return list(per_dp)
        return [ray.put(d) for d in per_dp]

    def train(
        self,
        rollout_id: int,
        per_dp_rank: list[list[Sample]],
        values: list[SampleValues] | None = None,
        refit: RefitAfterTrain | None = None,
        release: list[str] | None = None,
    ) -> dict[str, float]:
        """Train on one rollout; `per_dp_rank[d]` goes to every CP rank of data-parallel rank d (with `values[d]`,
        the critic's values of those samples, for --advantage-estimator ppo). With `release`, each rank serving
        an engine first releases those tags of it (`TrainWorker.release_own_engine`). With `refit`, the ranks
        then refit the engines in the same call (`miles.ray.colocate.RefitAfterTrain`; its seconds under
        `REFIT_SECONDS`)."""
        if len(per_dp_rank) != self.dp_size:
            raise ValueError(f"expected data for {self.dp_size} DP ranks, got {len(per_dp_rank)}")
        refs = self._shared(per_dp_rank)
        vrefs: list[ray.ObjectRef | SampleValues | None] = (
            [None] * self.dp_size if values is None else self._shared(values)
        )
        phase = f"{self.role} train rollout {rollout_id}"
        if refit is not None:
            phase += f", then weight refit {refit.weight_version}"
        results: list[dict[str, float]] = self._gather(
            [
                w.train.remote(
                    rollout_id,
                    refs[self.dims.coords(rank)[0]],
                    vrefs[self.dims.coords(rank)[0]],
                    refit,
                    release,
                )
                for rank, w in enumerate(self.workers)
            ],
            phase,
        )
        return results[0]

    def train_critic(
        self, rollout_id: int, per_dp_rank: list[list[Sample]]
    ) -> tuple[dict[str, float], list[SampleValues]]:
        """The critic role's train: (metrics, values per DP rank), values[d] in the order of per_dp_rank[d]."""
        if len(per_dp_rank) != self.dp_size:
            raise ValueError(f"expected data for {self.dp_size} DP ranks, got {len(per_dp_rank)}")
        refs = self._shared(per_dp_rank)
        answers: list[ValueTrainResult] = self._gather(
            [
                w.train_values.remote(rollout_id, refs[self.dims.coords(rank)[0]])
                for rank, w in enumerate(self.workers)
            ],
            f"critic train rollout {rollout_id}",
        )
        values = [answers[d * self.dims.replica_size]["values"] for d in range(self.dp_size)]
        return answers[0]["metrics"], values

    def save(self, rollout_id: int, extra_state: dict[str, JSON] | None = None) -> None:
        """Checkpoint on every rank; `extra_state` (plain data, e.g. the data cursor) is stored with it."""
        self._all(f"save checkpoint {rollout_id}", "save", rollout_id, extra_state)

    def resume_state(self) -> dict[str, JSON]:
        """The extra state of the checkpoint the ranks resumed from (rank 0's); {} for a fresh start."""
        return ray_get(
            self.workers[0].resume_state.remote(), self.timeout, "read the resumed checkpoint's state"
        )

    def save_hf(self, rollout_id: int) -> None:
        self._all(f"save HF model {rollout_id}", "save_hf", rollout_id)

    def sleep(self) -> None:
        self._all("offload training state", "sleep")

    def wake_up(self) -> None:
        self._all("onload training state", "wake_up")

    def update_weights(
        self, engine_urls: list[str], weight_version: str, flush_cache: bool = True
    ) -> dict[str, float]:
        """Refit on every rank; rank 0's refit metrics (`perf/refit_checksum_*`). `flush_cache`: False when
        the engines hold requests paused in place."""
        what = f"weight refit {weight_version}"
        return self._all(what, "update_weights", engine_urls, weight_version, flush_cache)[0] or {}

    def shutdown(self, grace_s: float = 10.0) -> None:
        """End every worker: first a normal exit (its interpreter shuts down, so finalizers run: the refit's
        shared-memory weight windows are unlinked), then, for a worker still busy after `grace_s`, SIGKILL."""
        exits = [w.__ray_terminate__.remote() for w in self.workers]
        ray.wait(exits, num_returns=len(exits), timeout=grace_s)
        for w in self.workers:
            ray.kill(w)
