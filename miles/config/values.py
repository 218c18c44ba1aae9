"""The merged, not yet frozen values validation works on, and how a rule reads them.

A field that failed an earlier check is "bad": a rule that reads it raises `Skip` and is skipped (`run_rules`),
so one mistake yields one message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

from miles.config.schema import FIELDS

DEFAULT = "default"
CLI = "command line"
DERIVED = "derived"


class Skip(Exception):
    """A rule read a field that already has a violation."""


class Values:
    """Merged raw values with their sources, the set of bad fields and the violations found so far."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str]) -> None:
        self.values = values
        self.sources = sources
        self.bad: set[str] = set()
        self.violations: list[str] = []

    def __getitem__(self, name: str) -> Any:
        if name in self.bad:
            raise Skip(name)
        return self.values[name]

    def set_derived(self, name: str, value: object) -> None:
        self.values[name] = value
        self.sources[name] = DERIVED

    def is_set(self, name: str) -> bool:
        """Whether the value came from the user (CLI, YAML or a dict), not a default or a derivation."""
        return self.sources[name] not in (DEFAULT, DERIVED)

    def describe(self, name: str) -> str:
        """`--flag=value`, plus where the value came from unless that was the command line."""
        text = f"{FIELDS[name].flag}={self.values[name]!r}"
        source = self.sources[name]
        return text if source == CLI else f"{text} [{source}]"

    def missing(self, name: str, why: str) -> None:
        self.violations.append(f"{FIELDS[name].flag} is required {why}")
        self.bad.add(name)

    def fail(self, name: str, problem: str) -> None:
        self.violations.append(f"{self.describe(name)}: {problem}")
        self.bad.add(name)


Rule = Callable[[Values], None]


def run_rules(v: Values, rules: Sequence[Rule]) -> None:
    """Apply each rule to `v`; a rule that reads a bad field stops there (its other checks are skipped)."""
    for rule in rules:
        with suppress(Skip):
            rule(v)
