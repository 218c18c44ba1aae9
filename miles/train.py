"""The synchronous RL driver: generate -> train -> save (periodic) -> refit -> eval (periodic).

`python -m miles.train --help` parses flags without importing torch or Ray; everything heavy is imported after the
configuration has been validated.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from miles.config import ConfigError
from miles.preflight import parse_config
from miles.ray.colocate import REFIT_SECONDS
from miles.utils.perf import peak_rss_gb, sample_counts, throughput

if TYPE_CHECKING:
    from miles.config import Config
    from miles.ray.system import System, TrainingSystem

logger = logging.getLogger("miles.train")


def num_rollouts(cfg: Config) -> int:
    """--num-rollout of a validated config (validation requires it)."""
    return cfg.rollout.num_rollout


def run_loop(cfg: Config, system: System) -> None:
    timer = system.timer
    eval_before_train(cfg, system)
    for rollout_id in range(system.start_rollout_id, num_rollouts(cfg)):
        with timer.phase("rollout"):
            samples, metrics = system.generate(rollout_id)
        metrics.update(sample_counts(samples))
        if system.mode != "rollout_only":  # --debug-rollout-only: generate and log only
            version = str(rollout_id + 1)
            # one trainer call trains and refits, unless a save is due between the two
            refit_in_train = None if any(save_due(cfg, rollout_id)) else version
            with timer.phase("train"):
                metrics.update(train_rollout(cfg, system, rollout_id, samples, refit_in_train))
            if REFIT_SECONDS in metrics:  # the trainers refitted the engines at the end of their train call
                timer.move("train", "refit", metrics.pop(REFIT_SECONDS))
            else:
                maybe_save(cfg, system, rollout_id)
                with timer.phase("refit"):
                    metrics.update(system.choreography.refit(weight_version=version) or {})
        finish_step(cfg, system, rollout_id, metrics)


def train_rollout(
    cfg: Config, system: TrainingSystem, rollout_id: int, samples: list, refit_version: str | None = None
) -> dict[str, float]:
    """Onload, then train: the critic first (--advantage-estimator ppo: its values feed the actor's GAE), then
    the actor, unless this rollout is one of the --num-critic-only-steps. With `refit_version`, the actor's train
    call also refits the engines when the choreography allows it (`MemoryChoreography.refit_with_train`; the
    answer then holds the refit's seconds under `REFIT_SECONDS`)."""
    per_dp = system.split_by_dp(samples)
    choreo, critic = system.choreography, system.critic_group
    release = choreo.before_train()  # tags the ranks release themselves, each its own engine
    metrics: dict[str, float] = {}
    values = None
    if critic is not None:
        critic_metrics, values = critic.train_critic(rollout_id, per_dp)
        metrics.update(critic_metrics)
        choreo.critic_done()
        if rollout_id < cfg.critic.num_critic_only_steps:
            return metrics
    refit = None if refit_version is None else choreo.refit_with_train(refit_version)
    metrics.update(system.train_group.train(rollout_id, per_dp, values, refit, release))
    return metrics


def save_due(cfg: Config, rollout_id: int) -> tuple[bool, bool]:
    """(checkpoint, HF export) due after `rollout_id`: --save every --save-interval rollouts and after the last;
    --save-hf every --save-hf-interval (default: --save-interval) and after the last."""
    ck, num = cfg.checkpoint, num_rollouts(cfg)
    return (
        bool(ck.save) and _due(ck.save_interval, rollout_id, num),
        bool(ck.save_hf) and _due(ck.save_hf_interval or ck.save_interval or num, rollout_id, num),
    )


def maybe_save(cfg: Config, system: TrainingSystem, rollout_id: int) -> None:
    """The checkpoint and the HF export `save_due` says are due."""
    save, save_hf = save_due(cfg, rollout_id)
    if save:
        with system.timer.phase("save"):
            system.save(rollout_id)
    if save_hf:
        with system.timer.phase("save_hf"):
            system.train_group.save_hf(rollout_id)


def eval_before_train(cfg: Config, system: System) -> None:
    """Evaluate the initial policy once (a fresh run with periodic eval, unless --skip-eval-before-train); its
    metrics go on their own line at the first step."""
    if cfg.eval.eval_interval and system.start_rollout_id == 0 and not cfg.eval.skip_eval_before_train:
        with system.timer.phase("eval"):
            metrics = system.evaluate(-1)
        metrics.update(system.timer.pop())
        system.tracker.log(system.start_rollout_id, metrics)
        print("before training: " + " ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())), flush=True)


def finish_step(cfg: Config, system: System, rollout_id: int, metrics: dict[str, float]) -> None:
    """Periodic eval, then one metrics line (file, wandb, tensorboard) and one printed line per rollout."""
    if _due(cfg.eval.eval_interval, rollout_id, num_rollouts(cfg)):
        with system.timer.phase("eval"):
            metrics.update(system.evaluate(rollout_id))
    timings = system.timer.pop()
    metrics.update(timings)
    metrics.update(throughput(metrics, step_seconds=sum(timings.values())))
    metrics["perf/driver_peak_rss_gb"] = peak_rss_gb()
    system.tracker.log(rollout_id, metrics)
    print(format_step(rollout_id, metrics), flush=True)
    system.progress.update()


def _due(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    """Periodic actions fire every `interval` rollouts and on the last one."""
    if not interval:
        return False
    return (rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout


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
    loop: Callable[[Config, System], None],
    prog: str,
    refuse: Callable[[Config], str | None] = lambda cfg: None,
) -> int:
    """Parse and validate, run the pre-flight checks (files, model, rewards, a prompt that fits
    --rollout-max-prompt-len: exit 2 on bad input; the cheap part of `python -m miles.tools.doctor`), honour
    --dry-run, then build the system and run `loop`. Nothing before `build_system` imports Ray.

    However the loop ends (done, an error, Ctrl-C) the system is shut down and `report.png` is drawn from the
    run's metrics.jsonl. Ctrl-C prints the phase it interrupted, kills the engines (no graceful drain) and
    returns 130."""
    from miles.preflight import PreflightError, run_preflight
    from miles.tools.doctor import prompt_fit_problem
    from miles.utils.log_setup import configure_logging

    try:
        cfg = parse_config(argv, prog=prog)
    except ConfigError as e:
        print(f"{prog}: invalid configuration\n{e}", file=sys.stderr)
        return 2
    problem = refuse(cfg)
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    configure_logging(cfg.log.log_level)  # third-party loggers from WARNING up (all at DEBUG)
    try:
        run_preflight(cfg)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    problem = prompt_fit_problem(cfg)  # else found only once Ray and the engines are up
    if problem:
        print(f"{prog}: {PreflightError([problem])}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        print(config_yaml(cfg), end="")
        return 0

    from miles.ray.setup import build_system
    from miles.utils import hang_dump
    from miles.utils.progress import progress_env, progress_wanted

    progress_env(progress_wanted(cfg.log.progress))
    if cfg.log.run_dir:  # SIGUSR1: every miles process dumps its stacks into <run-dir>/logs/hang-<time>/
        hang_dump.install(hang_dump.stacks_dir_of(cfg.log.run_dir), "driver", driver=True)
    try:
        system = build_system(cfg)
    except BaseException:
        import ray

        hang_dump.uninstall()
        ray.shutdown()  # engines, trainers and placement groups started so far go with it
        raise
    gc.freeze()  # start-up's objects (Ray, torch, the config) live for the run: full GC passes skip them
    interrupted = False
    try:
        loop(cfg, system)
    except KeyboardInterrupt:
        interrupted = True
        print(
            f"{prog}: interrupted (Ctrl-C) in phase '{system.timer.current or 'between phases'}'; "
            "stopping engines and workers",
            file=sys.stderr,
            flush=True,
        )
    finally:
        hang_dump.uninstall()
        try:
            system.shutdown(fast=interrupted)
        finally:
            write_report(cfg.log.run_dir)
    return 130 if interrupted else 0


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML that `--config` reads back to the same config (what --dry-run prints).

    Run-control keys (`dry_run`, `config`) are left out, and so are secrets that are set (API keys), with a
    closing comment naming them and where to put them (the environment, or a --config file only you can read)."""
    import yaml

    from miles.config import FIELDS
    from miles.config.secrets import where_to_put

    d = cfg.to_dict()
    for key in ("dry_run", "config"):
        d.pop(key)
    hidden = []
    for name, spec in FIELDS.items():
        owner = d if spec.section is None else d[spec.section]
        if spec.meta("secret") and owner.get(name) is not None:
            del owner[name]
            hidden.append(spec.flag)
    text = yaml.safe_dump(d, sort_keys=False, default_flow_style=False)
    if hidden:
        text += f"# not shown: {', '.join(hidden)} (secrets: {where_to_put(hidden)})\n"
    return text


def write_report(run_dir: str | None) -> None:
    """Draw `<run_dir>/report.png` from metrics.jsonl; a failure is logged, never raised (the run's own outcome
    must not be masked by its report). None (a config that never went through validation): nothing to draw."""
    if run_dir is None:
        return
    try:
        from miles.tools.plot import write_report as draw

        path = draw(run_dir)
    except Exception as e:  # noqa: BLE001 - reporting must not hide the run's real error
        logger.warning("could not draw the run report in %s: %s", run_dir, e)
        return
    if path is not None:
        print(f"report: {path}", flush=True)


def _refuse(cfg: Config) -> str | None:
    if cfg.rollout.fully_async:
        return "--fully-async runs with miles.train_async (issue 25): python -m miles.train_async"
    return None


def main(argv: list[str] | None = None, prog: str = "python -m miles.train") -> int:
    return run_driver(argv, run_loop, prog=prog, refuse=_refuse)


def cli() -> None:
    """The `miles-train` console script."""
    sys.exit(main(prog="miles-train"))


if __name__ == "__main__":
    sys.exit(main())
