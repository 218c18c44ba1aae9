"""`--router-*` flags: checked with sglang-router's own argument parser, turned into its command line.

sglang-router declares every option with a `router-` prefix when asked (`RouterArgs.add_cli_args(parser,
use_router_prefix=True)`); that parser is the source of truth for which `--router-NAME` flags exist, which values
they take and which policies there are (`--router-policy`). miles keeps the flags as `{NAME: VALUE}`
(`cfg.router.router_args`, dashes -> underscores) and passes each one to `python -m sglang_router.launch_router`
as `--NAME VALUE`. A switch takes `true`/`false`; a flag that takes several values holds them as one string,
split like a shell line.

Some flags are miles's to set (see `MILES_OWNED`, and docs/router.md): they are refused with the reason.

Importing this module imports nothing heavy; sglang-router is imported on first use. Without sglang-router,
`--help` and a run without `--router-*` flags work; `--router-policy` and the pass-through flags are refused,
naming the missing package (`RouterNotInstalled`).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import shlex
from typing import NoReturn

PREFIX = "--router-"

# flag -> why miles refuses it in the pass-through (it sets the value itself, or the mode does not fit a run)
MILES_OWNED: dict[str, str] = {
    "--router-policy": "is a miles flag of its own (--router-policy); it is not passed through twice",
    "--router-request-timeout-secs": "is derived from --rollout-request-timeout (a request may take that long)",
    "--router-disable-circuit-breaker": "is always set: dead engines are the health monitor's job, and an "
    "open circuit answers 503 for every request to a busy but healthy CPU engine",
    "--router-pd-disaggregation": "prefill/decode disaggregation is not supported: miles registers regular "
    "workers only",
    "--router-prefill": "prefill/decode disaggregation is not supported: miles registers regular workers only",
    "--router-decode": "prefill/decode disaggregation is not supported: miles registers regular workers only",
    "--router-mini-lb": "the Python mini load balancer has no worker API (/workers), which miles needs",
    "--router-service-discovery": "miles registers the engines itself (Kubernetes discovery would add others)",
    "--router-enable-igw": "the multi-model gateway mode does not take miles's worker registration",
    "--router-api-key": "miles registers each engine with the run's key (--engine-api-key) in the POST /workers "
    "body; a router key would sit on the router's command line and guard the router's own API",
}
# cb-* settings would only tune the circuit breaker that miles disables
_CIRCUIT_BREAKER = ("--router-cb-",)


class _RouterArgError(Exception):
    pass


class RouterNotInstalled(ImportError):
    """sglang-router, whose parser defines the `--router-*` flags and the policies, is not installed."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(
            f"sglang-router is not installed ({cause}); `pip install sglang-router` (the gpu extra has it)"
        )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _RouterArgError(message)


@functools.cache
def router_parser() -> argparse.ArgumentParser:
    """sglang-router's own parser with every option `--router-` prefixed (host, port and worker URLs left out:
    miles sets those)."""
    try:
        from sglang_router.router_args import RouterArgs
    except ImportError as e:
        raise RouterNotInstalled(e) from e

    parser = _Parser(prog="sglang_router.launch_router", add_help=False, allow_abbrev=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    return parser


def _actions() -> dict[str, argparse.Action]:
    return {s: a for a in router_parser()._actions for s in a.option_strings if s.startswith(PREFIX)}


def router_policies() -> tuple[str, ...]:
    """The policies sglang-router accepts for `--policy` (its parser's choices)."""
    choices = _actions()["--router-policy"].choices
    assert choices is not None, "sglang-router's --router-policy has no choices"
    return tuple(choices)


def flag_of(name: str) -> str:
    """`cache_threshold` -> `--router-cache-threshold`."""
    return PREFIX + name.replace("_", "-")


def _tokens(flag: str, value: str, action: argparse.Action) -> list[str]:
    """The argv tokens of one flag for its parser action; ValueError when the value cannot be one."""
    if action.nargs == 0:  # store_true / store_false
        lowered = value.strip().lower()
        if lowered in ("true", "yes", "on", "1", ""):
            return [flag]
        if lowered in ("false", "no", "off", "0"):
            return []
        raise ValueError(f"is a switch: true or false, got {value!r}")
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        return [flag, *shlex.split(value)]
    return [flag, value]


def router_arg_problems(router_args: dict[str, str]) -> list[tuple[str, str]]:
    """(`--router-NAME=VALUE`, problem) for every pass-through flag that sglang-router's parser rejects or
    miles owns (none given: nothing is imported)."""
    if not router_args:
        return []
    try:
        actions = _actions()
    except RouterNotInstalled as e:
        return [
            (f"{flag_of(name)}={value!r}", f"cannot be checked or passed on: {e}")
            for name, value in router_args.items()
        ]
    problems: list[tuple[str, str]] = []
    for name, value in router_args.items():
        flag = flag_of(name)
        given = f"{flag}={value!r}"
        if flag in MILES_OWNED:
            problems.append((given, f"cannot be passed through: it {MILES_OWNED[flag]}"))
            continue
        if flag.startswith(_CIRCUIT_BREAKER):
            problems.append((given, "has no effect: miles disables sglang-router's circuit breaker"))
            continue
        action = actions.get(flag)
        if action is None:
            close = difflib.get_close_matches(flag, list(actions), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append((given, f"sglang-router has no such option{hint}"))
            continue
        try:
            router_parser().parse_args(_tokens(flag, value, action))
        except (_RouterArgError, ValueError) as e:
            problems.append((given, f"sglang-router refuses {value!r}: {e}"))
    return problems


def router_command_args(router_args: dict[str, str]) -> list[str]:
    """The pass-through flags as sglang-router's own command line (`--NAME VALUE ...`, prefix dropped)."""
    actions = _actions()
    out: list[str] = []
    for name, value in router_args.items():
        flag = flag_of(name)
        out += ["--" + t[len(PREFIX) :] if t == flag else t for t in _tokens(flag, value, actions[flag])]
    return out
