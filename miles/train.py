"""The synchronous RL driver: generate -> train -> save (periodic) -> refit -> eval (periodic).

`python -m miles.train --help` parses flags without importing torch or Ray; everything heavy is imported after the
configuration has been validated.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from miles.config import ConfigError, parse_config

logger = logging.getLogger("miles.train")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"miles.train: invalid configuration\n{e}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        print(cfg.to_yaml())
        return 0
    cfg.raise_if_unimplemented()
    logging.basicConfig(level=cfg.log.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from miles.ray.setup import build_system

    system = build_system(cfg)
    try:
        run_loop(cfg, system)
    finally:
        system.shutdown()
    return 0


def run_loop(cfg: Any, system: Any) -> None:
    actor, choreo, tracker, timer = system.train_group, system.choreography, system.tracker, system.timer
    start = system.start_rollout_id
    for rollout_id in range(start, cfg.rollout.num_rollout):
        with timer.phase("rollout"):
            samples, metrics = system.generate(rollout_id)
        with timer.phase("train"):
            choreo.before_train()
            metrics.update(actor.train(rollout_id, system.split_by_dp(samples)))
        if _due(cfg.checkpoint.save_interval, rollout_id, cfg.rollout.num_rollout) and cfg.checkpoint.save:
            with timer.phase("save"):
                actor.save(rollout_id)
        with timer.phase("refit"):
            choreo.refit(weight_version=str(rollout_id + 1))
        if _due(cfg.eval.eval_interval, rollout_id, cfg.rollout.num_rollout):
            with timer.phase("eval"):
                metrics.update(system.evaluate(rollout_id))
        metrics.update(timer.pop())
        tracker.log(rollout_id, metrics)
        print(format_step(rollout_id, metrics), flush=True)


def _due(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    """Periodic actions fire every `interval` rollouts and on the last one."""
    return bool(interval) and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout)


def format_step(rollout_id: int, m: dict[str, float]) -> str:
    def g(key: str) -> float:
        return float(m.get(key, float("nan")))

    return (
        f"rollout {rollout_id}: reward {g('rollout/raw_reward'):.3f} loss {g('train/loss'):+.4f} "
        f"ppo_kl {g('train/ppo_kl'):+.2e} logprob_diff {g('train/train_rollout_logprob_abs_diff'):.2e} | "
        f"time rollout {g('timing/rollout'):.1f}s train {g('timing/train'):.1f}s refit {g('timing/refit'):.1f}s"
    )


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
