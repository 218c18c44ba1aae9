"""How a configuration field is declared: `opt` (a flag with its default), `resolved` (a flag validation always
fills in), `derived` (a value derived from flags, no flag itself), `section` (a class of them), and the helpers that read
declarations.

Nothing here imports torch, ray or transformers.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, dataclass_transform

_T = TypeVar("_T")

# Flags the parser accepts but whose feature is not built yet. `Config.raise_if_unimplemented()` raises
# NotImplementedError when any of them is set to a non-default value. Remove a name here once it lands.
NOT_IMPLEMENTED: frozenset[str] = frozenset()


@dataclass_transform(frozen_default=True, field_specifiers=(field, dataclasses.Field))
def section(cls: type[_T]) -> type[_T]:
    """Make `cls` a frozen dataclass section, marking the fields listed in NOT_IMPLEMENTED."""
    for name in NOT_IMPLEMENTED:
        spec = cls.__dict__.get(name)
        if isinstance(spec, dataclasses.Field):
            spec.metadata = MappingProxyType({**spec.metadata, "implemented": False})
    return dataclass(frozen=True)(cls)


def opt(
    default: _T,
    help: str,
    *,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    required: bool = False,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    cli: bool = True,
    secret: bool = False,
    resolved: bool = False,
    registry: str | None = None,
) -> _T:
    """Declare one config field: its default, a one-line help, and the checks applied after merging.

    `choices` may be a callable (evaluated lazily). Bounds apply when the value is not None. `cli=False` keeps the
    field out of the generated argparse parser (it is still a YAML key). `secret=True` redacts the value in
    `Config.to_yaml()`. `resolved=True`: see `resolved`. `registry`: the choices are a registry's outside the config
    (named here); the constants given as `choices` are listed in the docs, and `miles.preflight.server_flags`
    checks the value against the live registry (the config imports nothing from it).
    """
    metadata: dict[str, object] = {
        "help": help,
        "implemented": True,
        "required": required,
        "cli": cli,
        "secret": secret,
        "resolved": resolved,
        "registry": registry,
    }
    if choices is not None:
        metadata["choices"] = choices
    for key, bound in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)):
        if bound is not None:
            metadata[key] = bound
    if isinstance(default, (dict, list)):
        snapshot = default

        def factory() -> _T:
            return copy.copy(snapshot)  # a fresh container per instance, like the dict / list it copies

        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def resolved(
    help: str,
    *,
    required: bool = False,
    choices: Sequence[str] | None = None,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:  # the field's annotation: its resolved type
    """Declare a flag the user may leave unset (null, its default as the user sees it) that validation always
    fills in: a required flag (missing is a violation) or one derived from others (`miles.config.resolve`).

    The field is annotated with its resolved type (`int`, not `int | None`): a validated Config never holds None
    there, so readers use the value as it is. A section built directly (tests) holds None until validated."""
    return opt(None, help, required=required, choices=choices, gt=gt, ge=ge, lt=lt, le=le, resolved=True)


def derived(help: str) -> Any:  # the field's annotation: its type
    """Declare a value validation derives from flags, that is no flag itself (no CLI flag, no YAML key; left out
    of `Config.to_dict()`, recomputed by `Config.from_dict`). A section built directly (tests) holds None."""
    return field(default=None, metadata={"help": help, "derived": True})


def is_derived(f: dataclasses.Field[object]) -> bool:
    """Whether a section field is a `derived` value rather than a flag."""
    return bool(f.metadata.get("derived"))


def field_default(f: dataclasses.Field[object]) -> object:
    """The default value of a section field (its factory called when it has one)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"config field {f.name!r} has no default")
    return f.default_factory()
