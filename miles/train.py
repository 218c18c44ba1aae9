"""The synchronous RL driver: generate -> train -> save (periodic) -> refit -> eval (periodic).

`python -m miles.train --help` parses flags without importing torch or Ray; everything heavy is imported after the
configuration has been validated.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from miles.config import ConfigError, parse_config

logger = logging.getLogger("miles.train")


def run_loop(cfg: Any, system: Any) -> None:
    actor, choreo, timer = system.train_group, system.choreography, system.timer
    for rollout_id in range(system.start_rollout_id, cfg.rollout.num_rollout):
        with timer.phase("rollout"):
            samples, metrics = system.generate(rollout_id)
        with timer.phase("train"):
            choreo.before_train()
            metrics.update(actor.train(rollout_id, system.split_by_dp(samples)))
        maybe_save(cfg, system, rollout_id)
        with timer.phase("refit"):
            choreo.refit(weight_version=str(rollout_id + 1))
        finish_step(cfg, system, rollout_id, metrics)


def maybe_save(cfg: Any, system: Any, rollout_id: int) -> None:
    if cfg.checkpoint.save and _due(cfg.checkpoint.save_interval, rollout_id, cfg.rollout.num_rollout):
        with system.timer.phase("save"):
            system.train_group.save(rollout_id)


def finish_step(cfg: Any, system: Any, rollout_id: int, metrics: dict[str, float]) -> None:
    """Periodic eval, then one metrics line (file, wandb) and one printed line per rollout."""
    if _due(cfg.eval.eval_interval, rollout_id, cfg.rollout.num_rollout):
        with system.timer.phase("eval"):
            metrics.update(system.evaluate(rollout_id))
    metrics.update(system.timer.pop())
    system.tracker.log(rollout_id, metrics)
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


def run_driver(
    argv: list[str] | None,
    loop: Callable[[Any, Any], None],
    prog: str,
    refuse: Callable[[Any], str | None] = lambda cfg: None,
) -> int:
    """Parse and validate, run the pre-flight checks (files, model, rewards: exit 2 on bad input), honour
    --dry-run, then build the system and run `loop`. Nothing before `build_system` imports Ray."""
    from miles.config.preflight import run_preflight

    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"{prog}: invalid configuration\n{e}", file=sys.stderr)
        return 2
    problem = refuse(cfg)
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_preflight(cfg)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        print(cfg.to_yaml())
        return 0

    from miles.ray.setup import build_system

    system = build_system(cfg)
    try:
        loop(cfg, system)
    finally:
        system.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_driver(argv, run_loop, prog="miles.train")


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
