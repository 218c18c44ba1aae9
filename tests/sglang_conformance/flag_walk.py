"""Every field of SGLang's `ServerArgs` through miles: `--sglang-NAME [VALUE ...]` on miles's command line (and in
a `--config` YAML), miles's validation (SGLang's parser included), the engine's command line
(`EngineProcess.command`), `miles.engines.sglang_launch` (keys from the environment, SGLang's form), and SGLang's
own parser, as `sglang.launch_server` builds it.

Run with .venv-sglang's python, the repository on PYTHONPATH: `python flag_walk.py MODEL_DIR`. Prints one JSON
report; tests/integration/test_sglang_flags_conformance.py judges it. The value SGLang should hold for a flag is what SGLang's
parser makes of the canonical command line a user would type to SGLang itself (`--NAME=VALUE`, or `--NAME V1 V2`
for an option taking several); each value differs from the field's default, so a flag lost on the way is seen.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from sglang.srt.arg_groups.arg_utils import record_fields
from sglang.srt.server_args import ServerArgs, prepare_server_args

from miles.config import ConfigError
from miles.engines.sglang_args import MILES_OWNED
from miles.engines.sglang_engine import EngineProcess, engine_launch_kwargs
from miles.engines.sglang_launch import launch_argv
from miles.preflight import parse_config  # with the server-flag checks (SGLang's own parser), as the driver

KEY = "-" + "k" * 42  # an admin key starting with '-' (secrets.token_urlsafe draws one about once in 64)
PORT = 31234


def sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)  # as prepare_server_args
    ServerArgs.add_cli_args(parser)
    return parser


def primary(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-"))


def values_for(action: argparse.Action, i: int) -> list[str] | None:
    """Tokens of a value for `action` that differs from its default (None: a switch, given bare)."""
    if action.nargs == 0:
        return None
    if action.dest == "mem_fraction_static":  # also a declared miles flag, checked there: 0 < x < 1
        return ["0.625"]
    kind = getattr(action.type, "__name__", None)
    many = action.nargs in ("+", "*")
    if action.choices:
        choices = [c for c in action.choices if c != action.default] or list(action.choices)
        return [str(c) for c in choices[:2]] if many else [str(choices[0])]
    if type(action).__name__ == "LoRAPathAction":
        return [f"a{i}=/p", '{"lora_name": "n", "lora_path": "/q r"}']
    if many:  # argparse cannot take a value starting with '-' among several (nor can SGLang's own CLI)
        return {"int": ["1", "2", str(i)], "float": ["0.5", f"{i}.25"]}.get(kind, [f"a{i}", "b c"])
    special = {
        "int": str(1000 + i),
        "float": f"{i}.125",
        "human_readable_int": f"{i + 1}k",
        "loads": json.dumps({"k": f"v {i}"}),
        "json_list_type": json.dumps([f"a {i}", "b"]),
        "parse_cuda_graph_config_arg": json.dumps({"decode": {"max_bs": 8 + i}}),
    }
    return [special.get(kind, f"-v {i}")]  # str: starts with '-' and holds a space, one value all the same


def canonical(flag: str, tokens: list[str] | None, action: argparse.Action) -> list[str]:
    if tokens is None:
        return [flag]
    return [flag, *tokens] if action.nargs in ("+", "*") else [f"{flag}={tokens[0]}"]


def miles_argv(model: str, data: str, extra: list[str]) -> list[str]:
    return [
        "--hf-checkpoint", model, "--prompt-data", data, "--num-rollout", "2", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--rollout-num-gpus", "1",
        "--rollout-engine", "sglang", *extra,
    ]  # fmt: skip


def launched(model: str, sglang_args: dict[str, str]) -> list[str]:
    """The argv `sglang.launch_server` gets for an engine miles launches with `sglang_args`."""
    launch = engine_launch_kwargs("sglang", 0, 42, colocate=False, sglang_args=sglang_args)
    engine = EngineProcess(model, kind="sglang", port=PORT, tp_size=1, admin_api_key=KEY, **launch)
    command = engine.command()
    assert command[1:3] == ["-m", "miles.engines.sglang_launch"], command
    return launch_argv(command[3:], engine.launch_env())


def same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=repr) == json.dumps(b, sort_keys=True, default=repr)


def main(model: str) -> None:
    parser = sglang_parser()
    fields = [f.name for f in record_fields(ServerArgs)]
    actions = [a for a in parser._actions if a.option_strings and a.dest not in MILES_OWNED]
    default = parser.parse_args(["--model-path", model])
    report: dict[str, Any] = {"fields": len(fields), "mismatches": [], "unchanged": {}, "errors": []}

    walk = []  # (action, miles flag, tokens, expected namespace)
    for i, action in enumerate(actions):
        flag = primary(action)
        tokens = values_for(action, i)
        expected = parser.parse_args(["--model-path", model, *canonical(flag, tokens, action)])
        if same(getattr(expected, action.dest), getattr(default, action.dest)):
            if action.choices and all(c == action.default for c in action.choices):
                report["unchanged"][flag] = "its only choice is the default"
            elif action.nargs == 0 and action.default is True:
                report["unchanged"][flag] = "a switch on by default (the off run changes it)"
            else:
                report["unchanged"][flag] = "?"
        walk.append((action, flag, tokens, expected))
    report["walked_dests"] = sorted({a.dest for a, *_ in walk})

    def check(run: str, extra: list[str], cases: list[tuple[argparse.Action, str, Any]]) -> None:
        try:
            cfg = parse_config(miles_argv(model, model, extra))
        except ConfigError as e:
            report["errors"].append({"run": run, "violations": e.violations})
            return
        argv = launched(model, dict(cfg.engine.sglang_args))
        try:
            got = parser.parse_args(argv)
        except (argparse.ArgumentError, SystemExit) as e:  # SGLang's launch would exit here
            report["errors"].append({"run": run, "sglang": str(e), "argv": argv})
            return
        for action, flag, want in cases:
            if not same(getattr(got, action.dest), want):
                report["mismatches"].append(
                    {"run": run, "flag": flag, "dest": action.dest, "want": repr(want),
                     "got": repr(getattr(got, action.dest)), "argv": [t for t in argv if t.startswith(flag)]}
                )  # fmt: skip
        for dest, want in (("model_path", model), ("port", PORT), ("tp_size", 1), ("admin_api_key", KEY)):
            if getattr(got, dest) != want:
                report["mismatches"].append(
                    {"run": run, "dest": dest, "want": want, "got": getattr(got, dest)}
                )
        report.setdefault("runs", []).append(run)

    # run "cli": --sglang-NAME [VALUE ...] on the command line, switches bare
    extra: list[str] = []
    for _, flag, tokens, _ in walk:
        extra += ["--sglang-" + flag[2:], *(tokens or [])]
    check("cli", extra, [(a, f, getattr(e, a.dest)) for a, f, _, e in walk])

    # run "yaml": the same values in a --config file (YAML lists for several, strings otherwise), switches `true`
    with tempfile.TemporaryDirectory() as tmp:
        mapping: dict[str, Any] = {}
        for action, flag, tokens, _ in walk:
            many = action.nargs in ("+", "*")
            mapping[flag[2:]] = True if tokens is None else (tokens if many else tokens[0])
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump({"engine": {"sglang_args": mapping}}))
        check("yaml", ["--config", str(path)], [(a, f, getattr(e, a.dest)) for a, f, _, e in walk])

    # run "off": every switch `false` on the command line: SGLang holds what its own form for "off" gives (the
    # --no- form where the switch has one, else nothing: SGLang's default)
    switches = [(a, f) for a, f, tokens, _ in walk if tokens is None]
    extra = [t for _, f in switches for t in ("--sglang-" + f[2:], "false")]
    cases = []
    for action, flag in switches:
        negative = "--no-" + flag[2:]
        off = [negative] if negative in action.option_strings else []
        cases.append((action, flag, getattr(parser.parse_args(["--model-path", model, *off]), action.dest)))
    report["switches"] = len(switches)
    report["switches_with_no_form"] = sorted(f for a, f in switches if "--no-" + f[2:] in a.option_strings)
    check("off", extra, cases)

    # run "aliases": every other spelling SGLang accepts for a valued option, with the same value
    aliased = [
        (a, alias, tokens, e)
        for a, f, tokens, e in walk
        for alias in a.option_strings
        if alias != f and alias.startswith("--") and not alias.startswith("--no-")
    ]
    extra = [t for _, alias, tokens, _ in aliased for t in ("--sglang-" + alias[2:], *(tokens or []))]
    report["aliases"] = sorted(alias for _, alias, _, _ in aliased)
    check("aliases", extra, [(a, alias, getattr(e, a.dest)) for a, alias, _, e in aliased])

    # fields miles sets itself, and fields SGLang has no flag for: refused at validation, naming the flag
    refused = {}
    cli_dests = {a.dest for a in parser._actions}
    for name in [*sorted(MILES_OWNED), *(f for f in fields if f not in cli_dests)]:
        try:
            parse_config(miles_argv(model, model, ["--sglang-" + name.replace("_", "-"), "1"]))
            refused[name] = None
        except ConfigError as e:
            refused[name] = e.violations
    report["refused"] = refused
    report["no_cli_fields"] = sorted(f for f in fields if f not in cli_dests)

    # SGLang's whole start-up parse (prepare_server_args: ServerArgs built) of a plain engine's command line
    server_args = prepare_server_args(launched(model, {}))
    report["prepared"] = {"admin_api_key": server_args.admin_api_key, "random_seed": server_args.random_seed}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
