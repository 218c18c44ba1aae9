"""The one-step-off asynchronous driver: generation of rollout k+1 overlaps training on rollout k.

Only for disaggregated placement (engines and trainers on different workers): the engines keep generating with
the previous weights while the trainer steps, so every rollout is at most one policy version old. The refit waits
for the in-flight generation to finish, so weights never change in the middle of a rollout.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from miles.config import ConfigError, parse_config
from miles.train import _due, format_step

logger = logging.getLogger("miles.train_async")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"miles.train_async: invalid configuration\n{e}", file=sys.stderr)
        return 2
    if cfg.cluster.colocate:
        print(
            "miles.train_async: --colocate shares devices between engines and trainers, so generation cannot "
            "overlap training; use miles.train, or drop --colocate and set --rollout-num-gpus",
            file=sys.stderr,
        )
        return 2
    if cfg.dry_run:
        print(cfg.to_yaml())
        return 0
    cfg.raise_if_unimplemented()
    logging.basicConfig(level=cfg.log.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from miles.ray.setup import build_system

    system = build_system(cfg)
    try:
        run_async_loop(cfg, system)
    finally:
        system.shutdown()
    return 0


def run_async_loop(cfg: Any, system: Any) -> None:
    from miles.ray.utils import ray_get

    actor, choreo, tracker, timer = system.train_group, system.choreography, system.tracker, system.timer
    num = cfg.rollout.num_rollout

    def launch(rollout_id: int) -> Any:
        return system.rollout.generate.remote(rollout_id) if rollout_id < num else None

    in_flight = launch(system.start_rollout_id)
    for rollout_id in range(system.start_rollout_id, num):
        with timer.phase("rollout_wait"):
            samples, metrics = ray_get(in_flight, system.timeout, f"rollout {rollout_id}")
        in_flight = launch(rollout_id + 1)  # generated with the current (pre-update) weights
        with timer.phase("train"):
            metrics.update(actor.train(rollout_id, system.split_by_dp(samples)))
        if _due(cfg.checkpoint.save_interval, rollout_id, num) and cfg.checkpoint.save:
            with timer.phase("save"):
                actor.save(rollout_id)
        with timer.phase("refit"):
            next_rollout = (
                ray_get(in_flight, system.timeout, f"rollout {rollout_id + 1}") if in_flight else None
            )
            choreo.refit(weight_version=str(rollout_id + 1))
            in_flight = _ready(next_rollout)
        if _due(cfg.eval.eval_interval, rollout_id, num):
            with timer.phase("eval"):
                metrics.update(system.evaluate(rollout_id))
        metrics.update(timer.pop())
        tracker.log(rollout_id, metrics)
        print(format_step(rollout_id, metrics), flush=True)


def _ready(value: Any) -> Any:
    """Wrap an already-fetched rollout so the loop can `ray_get` it like a future."""
    if value is None:
        return None
    import ray

    return ray.put(value)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
