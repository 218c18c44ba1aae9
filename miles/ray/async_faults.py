"""`--use-fault-tolerance` in the asynchronous drivers (`miles.train_async`): the refit choreography owns the
health monitor, so an engine restart never races a pause, a refit or a continue.

The monitor watches (`/health_generate`) only while the engines generate freely. Before a refit the driver stops
the watch, which waits for a restart in progress and recovers an engine that died since; the engines are then
paused (fully async), the restarted ones refitted alone (their transport is new) and every engine refitted to the
new version. An engine that dies while paused or in the middle of that refit makes the refit raise on every
training rank: the engines that no longer answer `/health` (paused engines cannot answer /health_generate) are
restarted and the refit runs again, up to `REFIT_ATTEMPTS` times. The restarted engines rejoin the router only
after their refit, right before generation continues, so no engine generates unpaused or with old weights while
the others are paused. Requests that were running on a dead engine fail and the generate client sends them again
to an engine that remains (under a pause they wait there until the continue); a partial response keeps its
earlier segments (`miles.rollout.async_worker`), so a trajectory is resumed, never trained twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from miles.ray.utils import ray_get

if TYPE_CHECKING:
    from miles.ray.system import TrainSystem

logger = logging.getLogger(__name__)

REFIT_ATTEMPTS = 3  # refits of one step; each failure must have restarted an engine to try again


class AsyncFaults:
    """The engine-health side of the asynchronous drivers; every call is a no-op without --use-fault-tolerance."""

    def __init__(self, system: TrainSystem) -> None:
        self.system = system
        self.enabled = system.engines.cfg.cluster.use_fault_tolerance
        self.fleet = system.engines.fleet
        self.timeout = system.engines.timeout
        self.startup_timeout = float(system.engines.cfg.train.train_timeout)  # a restart loads a model
        self.restarts = 0

    def watch(self) -> None:
        """The engines generate freely: check their health."""
        if self.enabled:
            ray_get(self.fleet.start_watch.remote(), 60, "start engine health checks")

    def stop_watch(self) -> list[str]:
        """Stop checking before a pause or a refit; the engines restarted meanwhile (to refit, then readmit)."""
        if not self.enabled:
            return []
        return ray_get(self.fleet.stop_watch.remote(), self.startup_timeout, "engine restarts before a refit")

    def refit(
        self,
        version: str,
        refit: Callable[[], dict[str, float]],
        restarted: list[str],
    ) -> dict[str, float]:
        """`refit()` every engine to `version` (after refitting `restarted` alone), recovering engines that die
        meanwhile; then readmit the restarted engines."""
        choreo = self.system.choreography
        restarted = list(restarted)
        for attempt in range(1, REFIT_ATTEMPTS + 1):
            try:
                if restarted:
                    logger.warning(
                        "refitting restarted engine(s) %s with weight version %s", restarted, version
                    )
                    choreo.refit_restarted(restarted, weight_version=version)
                metrics = refit()
                break
            except Exception as e:
                if not self.enabled or attempt == REFIT_ATTEMPTS:
                    raise
                again = ray_get(self.fleet.recover_dead.remote(), self.startup_timeout, "engine restarts")
                if not again:  # no engine died: not a fault the monitor can mend
                    raise
                logger.warning("refit %s failed (%s); restarted %s, refitting again", version, e, again)
                restarted = sorted(set(restarted) | set(again))
        if restarted:
            ray_get(
                self.fleet.readmit.remote(restarted), self.timeout, f"refit {version}: router re-admission"
            )
            self.restarts += len(restarted)
        metrics = dict(metrics or {})
        if self.enabled:
            metrics["async/engine_restarts"] = float(len(restarted))
        return metrics
