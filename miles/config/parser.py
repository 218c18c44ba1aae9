"""Command line + YAML -> a frozen, validated Config, merged in one place: defaults < YAML < CLI.

The argparse parser is generated from the field declarations in `miles.config.sections`. Every option takes
its value as a string (booleans use `--x/--no-x`); typing, choices and bounds are checked after merging so
that one `ConfigError` lists every problem. `--sglang-NAME [VALUE ...]` for any NAME is collected into
`cfg.engine.sglang_args[NAME]` (dashes -> underscores; no value: "", a switch; several: one shell-quoted string;
see `miles.engines.sglang_args`); `--router-NAME [VALUE ...]` (any NAME but the declared `--router-policy`) into
`cfg.router.router_args[NAME]`. Both are checked with the servers' own parsers by `miles.preflight.parse_config`
(the driver's), which passes those checks in as extra rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from miles.config import secrets
from miles.config.core import Config, ConfigError
from miles.config.schema import (
    BOOL,
    FIELDS,
    LIST_INT,
    LIST_STR,
    SECTION_OF,
    FieldSpec,
    scalar_to_str,
    to_str_dict,
)
from miles.config.sections import SECTIONS
from miles.config.validate import CLI, DEFAULT, Rule, Values, resolve_and_validate

_SGLANG_PREFIX = "--sglang-"
_ROUTER_PREFIX = "--router-"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError instead of exiting on a malformed command line."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError([message])


def _metavar(spec: FieldSpec) -> str:
    choices = None if spec.meta("registry") else spec.choices  # a registry's: checked by miles.preflight
    if choices is not None:
        return "{" + ",".join(choices) + "}"
    return {"int": "INT", "float": "FLOAT", "dict": "JSON", LIST_INT: "INT"}.get(spec.kind, "STR")


DEFAULT_PROG = "python -m miles.train"


def build_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    """The argparse parser for every declared flag, grouped by section (parses to raw strings).

    Options default to "not given" (argparse.SUPPRESS) so the namespace holds only what the command line
    set; defaults are applied by the merge in `parse_config`. `prog` is the command `--help` names.
    A flag whose feature is not built (NOT_IMPLEMENTED) says so at the start of its help line.
    """
    parser = _Parser(
        prog=prog,
        usage="%(prog)s [--config RUN.yaml] [--FLAG VALUE ...] [--sglang-NAME [VALUE]] [--router-NAME VALUE ...]",
        description="miles: RL post-training with FSDP2 training actors and SGLang-protocol rollout engines.",
        epilog="Any --sglang-NAME [VALUE ...] is passed to the SGLang server as --NAME [VALUE ...] "
        "(collected into engine.sglang_args; a switch takes no value, or true/false); any --router-NAME VALUE "
        "to sglang-router as --NAME VALUE (router.router_args; see docs/router.md).",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    groups: dict[str | None, argparse._ArgumentGroup] = {None: parser.add_argument_group("run")}
    for name, cls in SECTIONS.items():
        groups[name] = parser.add_argument_group(name, (cls.__doc__ or "").strip().splitlines()[0])
    for name, spec in FIELDS.items():
        if not spec.meta("cli", True):
            continue
        group = groups[spec.section]
        help_text = f"{spec.help} (default: {spec.default!r})".replace("%", "%%")
        if not spec.meta("implemented", True):
            help_text = "[NOT BUILT: refused when set] " + help_text
        if spec.kind == BOOL:
            group.add_argument(spec.flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        elif spec.kind in (LIST_STR, LIST_INT):
            group.add_argument(spec.flag, dest=name, nargs="+", metavar=_metavar(spec), help=help_text)
        else:
            group.add_argument(spec.flag, dest=name, metavar=_metavar(spec), help=help_text)
    return parser


@dataclass
class Layer:
    """Values from one source, keyed by field name, plus SGLang and sglang-router pass-through args."""

    source: str
    values: dict[str, object] = field(default_factory=dict)
    sglang: dict[str, str] = field(default_factory=dict)
    router: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _cli_flags() -> list[str]:
    flags = ["--help"]
    for spec in FIELDS.values():
        if spec.meta("cli", True):
            flags.append(spec.flag)
            if spec.kind == BOOL:
                flags.append("--no-" + spec.flag[2:])
    return flags


def _hint(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _split_prefixed(
    argv: list[str], known: set[str], prefix: str, max_values: int | None
) -> tuple[list[str], list[tuple[str, str, str, list[str]]]]:
    """Take the undeclared `PREFIX-NAME [VALUE ...]` flags out of argv: (the rest of argv, one
    `(token, flag, key, values)` per such flag, in order). A flag's values are its `=VALUE`, else the tokens
    after it up to the next `--flag` (at most `max_values` of them; None: no limit)."""
    rest: list[str] = []
    found: list[tuple[str, str, str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        if not token.startswith(prefix) or flag in known:
            rest.append(token)
            i += 1
            continue
        values = [inline] if eq else []
        while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            if max_values is not None and len(values) >= max_values:
                break
            values.append(argv[i + 1])
            i += 1
        found.append((token, flag, flag[len(prefix) :].replace("-", "_"), values))
        i += 1
    return rest, found


def _split_sglang(argv: list[str], known: set[str], layer: Layer) -> list[str]:
    """Move undeclared `--sglang-NAME [VALUE ...]` out of argv into `layer.sglang`; return the rest.

    A flag with no value (followed by another `--flag` or the end) is recorded as "" (a switch, launched bare);
    several values (SGLang has options taking several) as one shell-quoted string."""
    return _split_server_flags(argv, known, _SGLANG_PREFIX, layer.sglang, layer, switch="")


def _split_router(argv: list[str], known: set[str], layer: Layer) -> list[str]:
    """Move undeclared `--router-NAME [VALUE ...]` out of argv into `layer.router`; return the rest.

    Every token up to the next `--flag` is a value (sglang-router has options taking several); several values
    are kept as one shell-quoted string. A flag with no value is recorded as "true" (a switch)."""
    return _split_server_flags(argv, known, _ROUTER_PREFIX, layer.router, layer, switch="true")


def _split_server_flags(
    argv: list[str], known: set[str], prefix: str, into: dict[str, str], layer: Layer, switch: str
) -> list[str]:
    """The undeclared `PREFIX-NAME [VALUE ...]` flags of argv into `into` (no value: `switch`; one: the value;
    several: one shell-quoted string), each problem into `layer.problems`; returns the rest of argv."""
    rest, found = _split_prefixed(argv, known, prefix, max_values=None)
    for token, flag, key, values in found:
        if not key:
            layer.problems.append(f"{token!r}: expected {prefix}NAME [VALUE ...]")
        elif key in into:
            layer.problems.append(f"{flag}: given twice")
        else:
            into[key] = values[0] if len(values) == 1 else (shlex.join(values) if values else switch)
    return rest


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _unknown_cli(extras: list[str], known: list[str]) -> list[str]:
    problems = []
    after_flag = False
    for token in extras:
        if token.startswith("-") and not _is_number(token):
            name = token.split("=", 1)[0]
            problems.append(f"{name}: unknown flag{_hint(name, known)}")
            after_flag = "=" not in token
        elif after_flag:
            after_flag = False  # the value of the unknown flag just reported
        else:
            problems.append(f"unexpected argument {token!r} (flags start with --)")
    return problems


def _assign(layer: Layer, name: str, value: object, key: str, allow_config: bool) -> None:
    if name == "sglang_args":
        if isinstance(value, Mapping):
            for sub_key, sub_value in value.items():
                if not isinstance(sub_key, str) or not sub_key:
                    layer.problems.append(f"{layer.source}: key {key!r}: keys must be non-empty strings")
                else:
                    _assign_sglang(layer, "sglang_" + sub_key, sub_value, f"{key}.{sub_key}")
            return
        try:
            layer.sglang.update(to_str_dict(value))  # a JSON object string
        except ValueError as e:
            layer.problems.append(f"{layer.source}: key {key!r}: {e}")
    elif name == "router_args":
        if not isinstance(value, Mapping):
            layer.problems.append(f"{layer.source}: key {key!r}: expected a mapping of sglang-router options")
            return
        for sub_key, sub_value in value.items():
            _assign_router(layer, "router_" + str(sub_key).replace("-", "_"), sub_value, f"{key}.{sub_key}")
    elif name == "config" and not allow_config:
        layer.problems.append(f"{layer.source}: key {key!r}: --config cannot be set inside a config file")
    elif name in layer.values:
        layer.problems.append(f"{layer.source}: key {key!r} sets {FIELDS[name].flag} a second time")
    else:
        layer.values[name] = value


def _assign_sglang(layer: Layer, name: str, value: object, key: str) -> None:
    """A YAML/dict value of a pass-through SGLang option: a scalar (a boolean is a switch on or off), None (a
    switch given without a value), or a list for an option taking several."""
    try:
        if value is None:
            text = ""
        elif isinstance(value, (list, tuple)):
            text = shlex.join(scalar_to_str(v) for v in value)
        else:
            text = scalar_to_str(value)
    except ValueError as e:
        layer.problems.append(f"{layer.source}: key {key!r}: {e}")
        return
    layer.sglang[name[len("sglang_") :].replace("-", "_")] = text


def _assign_router(layer: Layer, name: str, value: object, key: str) -> None:
    """A YAML/dict value of a pass-through router option: a scalar, or a list for an option taking several."""
    try:
        if isinstance(value, (list, tuple)):
            text = shlex.join(scalar_to_str(v) for v in value)
        else:
            text = scalar_to_str(value)
    except ValueError as e:
        layer.problems.append(f"{layer.source}: key {key!r}: {e}")
        return
    layer.router[name[len("router_") :]] = text


def normalize_mapping(data: Mapping[str, object], source: str, allow_config: bool = False) -> Layer:
    """Read a flat or section-nested mapping of flag names (dashes or underscores) into a Layer.

    Unknown keys become problems naming `source` and the key.
    """
    layer = Layer(source)
    known = sorted(FIELDS) + sorted(SECTIONS)
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS:
            if not isinstance(value, Mapping):
                layer.problems.append(f"{source}: key {key!r}: expected a mapping of {name} flags")
                continue
            for sub_key, sub_value in value.items():
                sub = str(sub_key).replace("-", "_")
                path = f"{key}.{sub_key}"
                if sub in FIELDS and SECTION_OF[sub] == name:
                    _assign(layer, sub, sub_value, path, allow_config)
                elif name == "engine" and sub.startswith("sglang_") and sub not in FIELDS:
                    _assign_sglang(layer, sub, sub_value, path)
                elif name == "router" and sub.startswith("router_") and sub not in FIELDS:
                    _assign_router(layer, sub, sub_value, path)
                elif sub in FIELDS:
                    where = SECTION_OF[sub] or "the top level"
                    layer.problems.append(f"{source}: unknown key {path!r} ({sub} belongs in {where})")
                else:
                    hint = _hint(sub, [n for n, s in SECTION_OF.items() if s == name])
                    layer.problems.append(f"{source}: unknown key {path!r}{hint}")
        elif name in FIELDS:
            _assign(layer, name, value, str(key), allow_config)
        elif name.startswith("sglang_"):
            _assign_sglang(layer, name, value, str(key))
        elif name.startswith("router_"):
            _assign_router(layer, name, value, str(key))
        else:
            layer.problems.append(f"{source}: unknown key {key!r}{_hint(name, known)}")
    return layer


def load_yaml(path: str) -> Layer:
    """Read a `--config` YAML file into a Layer; an unreadable or non-mapping file is a ConfigError."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError([f"--config={path!r}: cannot read the file: {e.strerror or e}"]) from e
    except yaml.YAMLError as e:
        raise ConfigError([f"--config={path!r}: invalid YAML: {e}"]) from e
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError([f"--config={path!r}: expected a mapping of flag names, got {type(data).__name__}"])
    return normalize_mapping(data, source=path)


def assemble(layers: list[Layer], rules: Sequence[Rule] = ()) -> Config:
    """Merge layers over the defaults (later wins), resolve, validate, and freeze into a Config.

    `rules`: checks beyond the config's own, run in the same pass (see `resolve_and_validate`)."""
    values = {name: spec.default for name, spec in FIELDS.items()}
    sources = dict.fromkeys(FIELDS, DEFAULT)
    sglang: dict[str, str] = {}
    router: dict[str, str] = {}
    problems: list[str] = []
    for layer in layers:
        problems.extend(layer.problems)
        for name, value in layer.values.items():
            values[name] = value
            sources[name] = layer.source
        if layer.sglang:
            sglang.update(layer.sglang)
            sources["sglang_args"] = layer.source
        if layer.router:
            router.update(layer.router)
            sources["router_args"] = layer.source
    values["sglang_args"] = sglang
    values["router_args"] = router
    v = Values(values, sources)
    v.violations.extend(problems)
    resolve_and_validate(v, rules)
    if v.violations:
        raise ConfigError(v.violations)
    top = {name: v.values[name] for name, spec in FIELDS.items() if spec.section is None}
    sections = {  # flags and derived values (train.steps_per_rollout)
        section: cls(**{f.name: v.values[f.name] for f in dataclasses.fields(cls)})
        for section, cls in SECTIONS.items()
    }
    return Config(**top, **sections)


def build_config(mappings: list[tuple[str, Mapping[str, object]]]) -> Config:
    """Config from (source name, mapping) layers, e.g. `[("from_dict", cfg.to_dict())]`."""
    return assemble([normalize_mapping(data, source, allow_config=True) for source, data in mappings])


def parse_config(
    argv: list[str] | None = None, prog: str = DEFAULT_PROG, rules: Sequence[Rule] = ()
) -> Config:
    """Parse `argv` (default: sys.argv[1:]) and the `--config` YAML it names into a validated Config.

    `rules`: checks beyond the config's own, in the same pass and error. The driver uses
    `miles.preflight.parse_config`, which adds the server-flag checks (SGLang's and sglang-router's parsers).

    Secrets (API keys) may also come from the environment (`MILES_ENGINE_API_KEY`, ...: see
    `miles.config.secrets`), below `--config` and the command line; one set on the command line, or in a
    `--config` file other users can read, draws a warning.

    Raises ConfigError listing every violation; `--help` prints usage (naming `prog`) and exits 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    known = _cli_flags()
    cli = Layer(CLI)
    rest = _split_router(_split_sglang(argv, set(known), cli), set(known), cli)
    namespace, extras = parser.parse_known_args(rest)
    cli.values = vars(namespace)
    cli.problems.extend(_unknown_cli(extras, known))
    layers = [Layer(secrets.ENVIRONMENT, dict(secrets.from_environment(os.environ))), cli]
    secrets.warn_on_command_line([n for n in secrets.secret_fields() if n in cli.values])
    config_path = cli.values.get("config")
    if config_path is not None:
        file_layer = load_yaml(str(config_path))  # argparse gives the --config flag's string
        secrets.warn_if_readable(
            str(config_path), [n for n in secrets.secret_fields() if n in file_layer.values]
        )
        layers.insert(1, file_layer)
    return assemble(layers, rules)
