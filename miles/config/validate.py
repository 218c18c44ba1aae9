"""Resolve derived values and collect every violation, on the merged (not yet frozen) values.

Order: per-field type/choices/bounds/required (`check_fields`) -> derived values (`miles.config.resolve`) ->
cross-field rules (`miles.config.rules`) -> the caller's extra rules (the driver adds the server-flag checks of
`miles.preflight.server_flags`, which need packages above the config). A field that failed an earlier check is
"bad": later rules that read it are skipped, so one mistake yields one message.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles.config.resolve import RESOLVERS
from miles.config.rules import RULES, is_loopback_host, loopback_engine_host_problem
from miles.config.schema import FIELDS, check_field, coerce
from miles.config.values import CLI, DEFAULT, DERIVED, Rule, Skip, Values, run_rules

__all__ = [
    "CLI",
    "DEFAULT",
    "DERIVED",
    "Rule",
    "Skip",
    "Values",
    "check_fields",
    "is_loopback_host",
    "loopback_engine_host_problem",
    "resolve_and_validate",
]


def check_fields(v: Values) -> None:
    """Coerce each value to its declared type, then check choices, bounds and `required`."""
    for name, spec in FIELDS.items():
        try:
            v.values[name] = coerce(spec, v.values[name])
        except ValueError as e:
            v.fail(name, str(e))
            continue
        problem = check_field(spec, v.values[name])
        if problem:
            v.fail(name, problem)
        elif spec.meta("required") and v.values[name] is None:
            v.missing(name, f"(pass {spec.flag} or set it in the --config YAML)")


def resolve_and_validate(v: Values, rules: Sequence[Rule] = ()) -> None:
    """Run every check and derivation on `v` in place; violations accumulate in `v.violations`.

    `rules`: checks run after the config's own, in the same pass (one error lists every violation). The driver's
    `miles.preflight.parse_config` passes the server-flag checks (SGLang's and sglang-router's parsers);
    `Config.from_dict` passes none."""
    check_fields(v)
    run_rules(v, RESOLVERS)
    run_rules(v, RULES)
    run_rules(v, rules)
