"""The flag registry derived from the dataclass declarations, and value coercion.

`FIELDS` maps every field name (= flag name with `-` -> `_`) to a `FieldSpec`. Raw values arrive as strings
(command line), as YAML scalars/lists/mappings, or as already-typed values (`Config.from_dict`); `coerce`
turns each into the declared type or raises ValueError with what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

from miles.config.core import Config
from miles.config.fields import field_default, is_derived
from miles.config.sections import SECTIONS

# kinds of field values the configuration supports
BOOL, INT, FLOAT, STR, DICT = "bool", "int", "float", "str", "dict"
LIST_STR, LIST_INT = "list[str]", "list[int]"
_KINDS: dict[object, str] = {bool: BOOL, int: INT, float: FLOAT, str: STR}


@dataclass(frozen=True)
class FieldSpec:
    """One declared field: where it lives, its kind, default and the checks from its metadata."""

    name: str
    section: str | None  # None: a run-wide field directly on Config
    kind: str
    optional: bool  # None is an allowed value (for a `resolved` field: as the not-given marker)
    field: dataclasses.Field

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def default(self) -> object:
        return field_default(self.field)

    @property
    def choices(self) -> tuple[str, ...] | None:
        choices = self.field.metadata.get("choices")
        if callable(choices):
            choices = choices()
        return tuple(choices) if choices is not None else None

    def meta(self, key: str, default: object = None) -> object:
        return self.field.metadata.get(key, default)


def _kind_of(tp: object, where: str) -> tuple[str, bool]:
    """(kind, optional) of a resolved annotation such as `int | None` or `list[str] | None`."""
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        assert len(args) == 1, f"{where}: only `T | None` unions are supported, got {tp}"
        tp = args[0]
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        kind = {str: LIST_STR, int: LIST_INT}.get(item)
    elif origin is dict:
        kind = DICT if typing.get_args(tp) == (str, str) else None
    else:
        kind = _KINDS.get(tp)
    assert kind is not None, f"{where}: unsupported config field type {tp}"
    return kind, optional


def _build_registry() -> dict[str, FieldSpec]:
    registry: dict[str, FieldSpec] = {}
    owners: list[tuple[str | None, type]] = [(None, Config), *SECTIONS.items()]
    for section_name, cls in owners:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (section_name is None and f.name in SECTIONS) or is_derived(f):
                continue  # a section, or a derived value that is no flag
            assert f.name not in registry, f"config field {f.name!r} is declared twice"
            assert f.metadata.get("help"), f"config field {f.name!r} has no help line"
            kind, optional = _kind_of(hints[f.name], f"{cls.__name__}.{f.name}")
            optional = optional or bool(f.metadata.get("resolved"))
            registry[f.name] = FieldSpec(f.name, section_name, kind, optional, f)
    return registry


FIELDS: dict[str, FieldSpec] = _build_registry()
SECTION_OF: dict[str, str | None] = {name: spec.section for name, spec in FIELDS.items()}


def _to_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
    raise ValueError("expected true or false")


def _to_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError("expected an integer")


def _to_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, (int, float)):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            raise ValueError("expected a number") from None
    else:
        raise ValueError("expected a number")
    if math.isnan(result):
        raise ValueError("expected a number, got NaN")
    return result


def _to_str(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"expected a string, got {type(value).__name__} (quote it in YAML)")


def scalar_to_str(value: object) -> str:
    """A scalar as the string a server command line would carry (`true`/`false` for booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"expected a scalar (string, number or boolean), got {type(value).__name__}")


def to_str_dict(value: object) -> dict[str, str]:
    """A mapping (or a JSON object string) of scalars as `dict[str, str]`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f'invalid JSON ({e}); expected an object such as \'{{"NCCL_DEBUG": "INFO"}}\''
            ) from None
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a JSON object of strings, got {type(value).__name__}")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"keys must be non-empty strings, got {key!r}")
        try:
            out[key] = scalar_to_str(item)
        except ValueError as e:
            raise ValueError(f"value of {key!r}: {e}") from None
    return out


def _to_list(value: object, item: Callable[[object], object]) -> list[object]:
    if isinstance(value, (list, tuple)):
        return [item(v) for v in value]
    return [item(value)]


def coerce(spec: FieldSpec, value: object) -> object:
    """Convert a raw value (CLI string, YAML value or typed value) to `spec`'s kind; ValueError if it cannot."""
    if value is None:
        if spec.optional:
            return None
        raise ValueError("cannot be null")
    if spec.kind == BOOL:
        return _to_bool(value)
    if spec.kind == INT:
        return _to_int(value)
    if spec.kind == FLOAT:
        return _to_float(value)
    if spec.kind == STR:
        return _to_str(value)
    if spec.kind == LIST_STR:
        return _to_list(value, _to_str)
    if spec.kind == LIST_INT:
        return _to_list(value, _to_int)
    if spec.kind == DICT:
        return to_str_dict(value)
    raise AssertionError(f"unhandled kind {spec.kind}")


def check_field(spec: FieldSpec, value: object) -> str | None:
    """The problem with a coerced value against the field's choices and bounds, or None. Float values must be
    finite (NaN is already refused by coercion). Choices of a field with a `registry` are checked by
    `miles.preflight.server_flags` against that registry."""
    if value is None:
        return None
    if spec.kind == FLOAT and not math.isfinite(cast(float, value)):  # coerced: a float
        return "must be a finite number"  # no float flag means "unlimited": inf lr, timeouts, ... are typos
    choices = spec.choices
    if choices is not None and value not in choices and not spec.meta("registry"):
        return f"must be one of {{{', '.join(choices)}}}"
    items = value if isinstance(value, list) else [value]
    for key, op, text in (
        ("gt", lambda a, b: a > b, ">"),
        ("ge", lambda a, b: a >= b, ">="),
        ("lt", lambda a, b: a < b, "<"),
        ("le", lambda a, b: a <= b, "<="),
    ):
        bound = spec.meta(key)
        if bound is not None and isinstance(value, (int, float, list)):
            if not all(op(v, bound) for v in items):
                return f"must be {text} {bound}" + (" (each item)" if isinstance(value, list) else "")
    return None
