"""The asynchronous drivers: one-step-off (generation of rollout k+1 overlaps training on rollout k) and, with
`--fully-async`, a persistent generation worker that never stops for training (docs/async.md).

Only for disaggregated placement (engines and trainers on different workers): the engines keep generating with
the previous weights while the trainer steps, so every rollout is at most one policy version old. The refit waits
for the in-flight generation to finish, so weights never change in the middle of a rollout (nor of an agent
session of --use-session-server: a session lives inside one rollout's generation).

Fully async: the rollout manager's worker keeps samples in flight and buffers finished groups; each step takes a
batch as soon as one is buffered, trains, and every --update-weights-interval steps pauses the engines
(--pause-generation-mode), refits them under the paused requests and lets generation continue.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from miles.ray.async_faults import AsyncFaults
from miles.train import (
    _due,
    eval_before_train,
    finish_step,
    maybe_save,
    num_rollouts,
    run_driver,
    train_rollout,
)
from miles.utils.perf import sample_counts

if TYPE_CHECKING:
    from miles.config import Config
    from miles.ray.system import System, TrainSystem

OVERLAP_ENV = "MILES_DRIVER_OVERLAPS_TRAINING"  # "1" in this driver's process: read by miles.ray.setup


def run_async_loop(cfg: Config, system: System) -> None:
    import ray

    from miles.ray.utils import ray_get

    if system.mode != "train":  # _refuse turns away the replay-debugging modes
        raise RuntimeError("miles.train_async needs engines and a train group (no replay debugging)")
    choreo, timer = system.choreography, system.timer
    num = num_rollouts(cfg)
    deadline = system.rollout_deadline  # the whole rollout's, not one request's

    faults = AsyncFaults(system)

    def launch(rollout_id: int) -> ray.ObjectRef | None:
        if rollout_id >= num:
            return None
        faults.watch()  # the engines generate: health checks on (--use-fault-tolerance)
        return system.engines.rollout.generate.remote(rollout_id)

    eval_before_train(cfg, system)
    in_flight = launch(system.start_rollout_id)
    for rollout_id in range(system.start_rollout_id, num):
        with timer.phase("rollout"):  # the time spent waiting for it
            samples, metrics = ray_get(in_flight, deadline, f"rollout {rollout_id}")
        in_flight = launch(rollout_id + 1)  # generated with the current (pre-update) weights
        metrics.update(sample_counts(samples))
        with timer.phase("train"):
            metrics.update(train_rollout(cfg, system, rollout_id, samples))
        maybe_save(cfg, system, rollout_id)
        with timer.phase("refit"):
            if in_flight is not None:  # never change weights under a running generation
                in_flight = ray.put(ray_get(in_flight, deadline, f"rollout {rollout_id + 1}"))
            version = str(rollout_id + 1)

            def refit(v: str = version) -> dict[str, float]:
                choreo.refit(weight_version=v)
                return {}  # (this driver reports no refit metrics)

            # async/engine_restarts with --use-fault-tolerance, else nothing
            metrics.update(faults.refit(version, refit, faults.stop_watch()))
        finish_step(cfg, system, rollout_id, metrics)


def run_fully_async_loop(cfg: Config, system: System) -> None:
    from miles.ray.utils import ray_get

    if system.mode != "train":  # _refuse turns away the replay-debugging modes
        raise RuntimeError("miles.train_async needs engines and a train group (no replay debugging)")
    r, timer = cfg.rollout, system.timer
    rollout, timeout = system.engines.rollout, system.engines.timeout
    num = num_rollouts(cfg)
    faults = AsyncFaults(system)
    eval_before_train(cfg, system)
    ray_get(rollout.start_async.remote(system.start_rollout_id), timeout, "start the generation worker")
    faults.watch()
    try:
        for rollout_id in range(system.start_rollout_id, num):
            with timer.phase("rollout"):  # the time spent waiting for a full batch in the buffer
                samples, metrics = ray_get(
                    rollout.take_batch.remote(rollout_id), system.rollout_deadline, f"rollout {rollout_id}"
                )
            metrics.update(sample_counts(samples))
            with timer.phase("train"):
                metrics.update(train_rollout(cfg, system, rollout_id, samples))
            maybe_save(cfg, system, rollout_id)
            if _due(r.update_weights_interval, rollout_id, num):
                with timer.phase("refit"):  # under paused requests: generation goes on after
                    metrics.update(_paused_refit(cfg, system, faults, rollout_id + 1))
            finish_step(cfg, system, rollout_id, metrics)
        faults.stop_watch()  # no restart under the shutdown
    finally:
        ray_get(rollout.stop_async.remote(), timeout, "stop the generation worker")


def _paused_refit(cfg: Config, system: TrainSystem, faults: AsyncFaults, version: int) -> dict[str, float]:
    """Pause the engines (--pause-generation-mode), refit them to `version` and continue; with
    --use-fault-tolerance the health monitor stops watching for it and dead engines are restarted, refitted and
    readmitted before the continue (`miles.ray.async_faults`)."""
    from miles.ray.utils import ray_get

    r, rollout, timeout = cfg.rollout, system.engines.rollout, system.engines.timeout
    t0 = time.perf_counter()
    restarted = faults.stop_watch()
    ray_get(rollout.pause_generation.remote(r.pause_generation_mode), timeout, "pause")
    t1 = time.perf_counter()
    # requests held in place keep their KV cache: the update must not flush it
    flush = r.pause_generation_mode != "in_place"

    def refit() -> dict[str, float]:
        return system.choreography.refit(weight_version=str(version), flush_cache=flush) or {}

    metrics = faults.refit(str(version), refit, restarted)
    t2 = time.perf_counter()
    ray_get(rollout.continue_generation.remote(version), timeout, "continue")
    faults.watch()
    t3 = time.perf_counter()
    return metrics | {
        "timing/async_pause": t1 - t0,
        "timing/async_refit": t2 - t1,
        "timing/async_continue": t3 - t2,
    }


def _loop(cfg: Config, system: System) -> None:
    (run_fully_async_loop if cfg.rollout.fully_async else run_async_loop)(cfg, system)


def _refuse(cfg: Config) -> str | None:
    dbg = cfg.debug
    if dbg.save_debug_rollout_data or dbg.load_debug_rollout_data or dbg.debug_rollout_only:
        return "replay debugging (--*-debug-rollout-data, --debug-rollout-only) runs with miles.train"
    if cfg.cluster.colocate:
        return (
            "--colocate shares devices between engines and trainers, so generation cannot overlap training; "
            "use miles.train, or drop --colocate and set --rollout-num-gpus"
        )
    return None


def main(argv: list[str] | None = None, prog: str = "python -m miles.train_async") -> int:
    # tells miles.ray.setup that the engines generate while the ranks train (one-step-off: always; fully async:
    # unless bound 0), so CPU ranks leave the engines' cores to them; restored after (tests call main in-process)
    before = os.environ.get(OVERLAP_ENV)
    os.environ[OVERLAP_ENV] = "1"
    try:
        return run_driver(argv, _loop, prog=prog, refuse=_refuse)
    finally:
        if before is None:
            os.environ.pop(OVERLAP_ENV, None)
        else:
            os.environ[OVERLAP_ENV] = before


def cli() -> None:
    """The `miles-train-async` console script."""
    sys.exit(main(prog="miles-train-async"))


if __name__ == "__main__":
    sys.exit(main())
