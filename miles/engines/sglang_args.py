"""`--sglang-*` flags: kept as strings, launched in SGLang's own form, checked with SGLang's own parser.

miles keeps the flags as `{NAME: VALUE}` strings (`cfg.engine.sglang_args`, dashes -> underscores):

- `""`: the flag was given without a value (`--sglang-enable-metrics`): launched bare, `--enable-metrics`;
- `"true"` / `"false"` (also YAML booleans): a switch on or off;
- several values (`--sglang-cuda-graph-bs-decode 1 2 4`, or a YAML list): one string, split like a shell line;
- anything else: the value, launched in its flag's token (`--NAME=VALUE`, so a value starting with '-' stays a
  value).

`flag_args` makes that command line without SGLang (the driver need not have it installed). In the engine's own
process (`miles.engines.sglang_launch`) `sglang_form` turns it into SGLang's form with SGLang's parser: a switch
`--NAME=true` becomes `--NAME`; `--NAME=false` becomes `--no-NAME` for a switch SGLang declares with both forms
(`BooleanOptionalAction`) and is left out for a plain switch (`store_true`: off is SGLang's default); an option
taking several values gets them as separate tokens. Where SGLang is installed, validation runs the same
translation and SGLang's parser on every flag (`sglang_arg_problems`), so a bad name or value fails `--dry-run`.

Some flags are miles's to set (`MILES_OWNED`): they are refused with the reason, SGLang installed or not.

Importing this module imports nothing heavy; SGLang's parser is built on first use.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.util
import shlex
from collections.abc import Mapping
from typing import NoReturn

PREFIX = "--sglang-"

_OWNED_KEYS = (
    "is --engine-api-key: the engines' keys go by environment, never on a command line (any local user can "
    "read it)"
)
# SGLang option (by its dest, aliases included) -> why miles refuses it in the pass-through
MILES_OWNED: dict[str, str] = {
    "model_path": "is --hf-checkpoint (every engine starts on the policy's weights)",
    "host": "is --engine-host",
    "port": "is picked by miles for each engine (a free port, told to the router and the trainers)",
    "tp_size": "is --rollout-num-gpus-per-engine (the GPUs miles places for each engine)",
    "api_key": _OWNED_KEYS,
    "admin_api_key": _OWNED_KEYS,
    "config": "would read SGLang options from a YAML file past these checks: pass each as --sglang-NAME VALUE",
    "help": "prints SGLang's help and exits: run `python -m sglang.launch_server --help`",
}
# the spellings of MILES_OWNED that SGLang 0.5.23 accepts, for a check without SGLang installed
_OWNED_NAMES = {
    **{name: name for name in MILES_OWNED},
    "model": "model_path",
    "tensor_parallel_size": "tp_size",
}

_ON, _OFF = ("true", "yes", "on", "1", ""), ("false", "no", "off", "0")


def flag_of(name: str) -> str:
    """`enable_metrics` -> `--sglang-enable-metrics` (the flag a user gives)."""
    return PREFIX + name.lstrip("-").replace("_", "-")


def server_flag(name: str) -> str:
    """`enable_metrics` -> `--enable-metrics` (SGLang's flag)."""
    return "--" + name.lstrip("-").replace("_", "-")


def given(name: str, value: object) -> str:
    """How a flag was given, for messages: `--sglang-NAME`, or `--sglang-NAME='VALUE'`."""
    return flag_of(name) if value == "" or value is True else f"{flag_of(name)}={value!r}"


def flag_args(args: Mapping[str, object] | None) -> list[str]:
    """A server's command line from `{NAME: VALUE}`, without knowing the server's options:
    `{'mem_fraction_static': '0.7', 'enable_x': '', 'enable_y': True, 'enable_z': False}` ->
    `['--mem-fraction-static=0.7', '--enable-x', '--enable-y']`. A value-less flag ("" or True) is bare,
    False/None is left out, any other value rides in its flag's token (`--NAME=VALUE`)."""
    out: list[str] = []
    for name, value in (args or {}).items():
        flag = server_flag(name)
        if value is True or value == "":
            out.append(flag)
        elif value is not False and value is not None:
            out.append(f"{flag}={value}")
    return out


def switch_value(value: str) -> bool | None:
    """A switch's value: True (`true`, `yes`, `on`, `1`, or none), False (`false`, `no`, `off`, `0`), or None
    when it is neither."""
    lowered = value.strip().lower()
    if lowered in _ON:
        return True
    if lowered in _OFF:
        return False
    return None


def sglang_form(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (from `flag_args`) in the form `parser` (SGLang's) reads: `--SWITCH=true` -> `--SWITCH`;
    `--SWITCH=false` -> its `--no-` form where it has one, else nothing; `--MANY=V1 V2` -> `--MANY V1 V2` for
    an option taking several values. Other tokens are left as they are (SGLang's parser judges them)."""
    actions = parser._option_string_actions
    out: list[str] = []
    for token in argv:
        flag, eq, value = token.partition("=")
        action = actions.get(flag) if eq and flag.startswith("--") else None
        if action is None:
            out.append(token)
        elif action.nargs == 0:
            on = switch_value(value)
            if on is None:
                out.append(token)  # SGLang's parser says why ("ignored explicit argument")
            elif on:
                out.append(flag)
            else:  # the opposite form where the switch has one (BooleanOptionalAction), else SGLang's default
                opposite = "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]
                out += [opposite] if opposite in action.option_strings else []
        elif action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 0):
            out += [flag, *shlex.split(value)]
        else:
            out.append(token)
    return out


def sglang_seeds_requests(sglang_args: Mapping[str, object]) -> bool:
    """Whether SGLang launched with these flags honours a request's `sampling_seed`: only under
    `--enable-deterministic-inference` (SGLang's sampler draws from per-request seeds only then) or
    `--rl-on-policy-target`, which turns it on."""
    args = {str(k).replace("-", "_"): v for k, v in sglang_args.items()}
    value = args.get("enable_deterministic_inference")
    on = value is True or (isinstance(value, str) and switch_value(value) is True)
    return on or args.get("rl_on_policy_target") not in (None, False, "", "None")


class _SGLangArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _SGLangArgError(message)


@functools.cache
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own server-argument parser (`ServerArgs.add_cli_args`, as `sglang.launch_server` builds it),
    raising instead of exiting. Imports SGLang (and torch with it)."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang serve", add_help=False, allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_installed() -> bool:
    """Whether `sglang` can be imported here (not importing it)."""
    try:
        return importlib.util.find_spec("sglang") is not None
    except ValueError:  # sys.modules["sglang"] is None: imports of it are blocked
        return False


def owned_problems(args: Mapping[str, str]) -> list[tuple[str, str]]:
    """(flag as given, problem) for every flag miles sets itself (no SGLang needed)."""
    problems = []
    for name, value in args.items():
        owner = _OWNED_NAMES.get(name.replace("-", "_"))
        if owner is not None:
            problems.append((given(name, value), f"cannot be passed through: it {MILES_OWNED[owner]}"))
    return problems


def parser_problems(args: Mapping[str, str]) -> list[tuple[str, str]]:
    """(flag as given, problem) for every flag SGLang's own parser rejects, launched as miles launches it.
    Imports SGLang: call it only where SGLang is installed and flags were given."""
    try:
        parser = sglang_parser()
    except Exception as e:  # an installed SGLang that does not import cannot start engines either
        return [
            (flag_of(name), f"cannot be checked: SGLang's server arguments do not import ({e})")
            for name in args
        ]
    actions = parser._option_string_actions
    problems: list[tuple[str, str]] = []
    for name, value in args.items():
        flag = server_flag(name)
        action = actions.get(flag)
        if action is None:
            options = [s[2:] for s in actions if s.startswith("--")]
            close = difflib.get_close_matches(flag[2:], options, n=1)
            hint = f" (did you mean {PREFIX + close[0]!r}?)" if close else ""
            problems.append((given(name, value), f"SGLang has no such option{hint}"))
            continue
        if action.dest in MILES_OWNED:
            if name.replace("-", "_") not in _OWNED_NAMES:  # an alias owned_problems does not know
                problems.append(
                    (given(name, value), f"cannot be passed through: it {MILES_OWNED[action.dest]}")
                )
            continue
        if action.nargs == 0 and switch_value(value) is None:
            problems.append((given(name, value), "is a switch: give it no value, true or false"))
            continue
        try:
            parser.parse_args(["--model-path", "m", *sglang_form(flag_args({name: value}), parser)])
        except _SGLangArgError as e:
            problems.append((given(name, value), f"SGLang refuses it: {e}"))
        except Exception as e:  # an option's own action may raise (e.g. --lora-paths on a malformed JSON)
            problems.append((given(name, value), f"SGLang refuses it: {type(e).__name__}: {e}"))
    return problems
