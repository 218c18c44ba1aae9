"""Cross-field rules of `--fully-async` (issue 25): its flags only with it, and what it does not build refused."""

from __future__ import annotations

from contextlib import suppress

from miles.config.schema import FIELDS
from miles.config.values import Skip, Values

DEFAULT_ROLLOUT_FUNCTION = "miles.rollout.default_rollout.generate_rollout"
_ASYNC_ONLY = (
    "async_max_concurrent_samples",
    "async_data_buffer_capacity_factor",
    "async_unused_samples_handler",
    "max_weight_staleness",
    "update_weights_interval",
    "pause_generation_mode",
)
# flags --fully-async does not combine with yet: refused, never ignored
_CONFLICTS = {
    "colocate": "engines and trainers share devices, so generation cannot go on while the trainer trains",
    "use_session_server": (
        "agent sessions do not continue across the worker's refits yet (a turn's weight version would change "
        "mid-episode); the one-step-off driver (without --fully-async) runs them"
    ),
    "partial_rollout": "the worker always continues aborted samples; the flag has no effect",
    "debug_rollout_only": "the worker needs trainers to refit the engines",
}


def fully_async(v: Values) -> None:
    """--fully-async: its flags only with it; `_CONFLICTS` refused; a batch fits the buffer; the pacing rule
    can always admit (a refit every I steps leaves the engines I - 1 versions behind)."""
    with suppress(Skip):
        if not v["fully_async"]:
            for name in _ASYNC_ONLY:
                with suppress(Skip):
                    if v.is_set(name) and v[name] != FIELDS[name].default:
                        v.fail(name, "takes effect only with --fully-async (issue 25)")
            return
        for name, why in _CONFLICTS.items():
            with suppress(Skip):
                if v[name]:
                    v.fail(name, f"is not supported with --fully-async (issue 25): {why}")
        with suppress(Skip):
            if v["rollout_function_path"] != DEFAULT_ROLLOUT_FUNCTION:
                v.fail(
                    "rollout_function_path",
                    "is not used with --fully-async (issue 25): the worker generates group by group with the "
                    "generate function (--custom-generate-function-path)",
                )
        with suppress(Skip):
            if v["lora_rank"] and v["lora_refit"] == "adapter":
                v.fail("lora_refit", "adapter is not supported with --fully-async (issue 25); use merged")
        with suppress(Skip):
            bound, interval = v["max_weight_staleness"], v["update_weights_interval"]
            if bound is not None and bound < interval - 1:
                v.fail(
                    "max_weight_staleness",
                    f"must be >= --update-weights-interval - 1 = {interval - 1}: between two refits the engines "
                    "fall that many versions behind the trained policy, so no prompt could start",
                )
