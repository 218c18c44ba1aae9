"""`Config`: the frozen, resolved run configuration, and `ConfigError`."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import field
from typing import Any, TypeVar

from miles.config.fields import field_default, is_derived, opt
from miles.config.sections import (
    AlgoConfig,
    CheckpointConfig,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    DebugConfig,
    EngineConfig,
    EvalConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RouterConfig,
    TrainConfig,
    section,
)

T = TypeVar("T")


def _section_name(cfg: Config, owner: object) -> str:
    return next(f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) is owner)


class ConfigError(ValueError):
    """Every violation found in one configuration, one per line."""

    def __init__(self, violations: list[str], title: str = "invalid configuration") -> None:
        self.violations = list(violations)
        count = len(self.violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{title} ({count} problem{'s' if count != 1 else ''}):\n{lines}")


def required(value: T | None, flag: str) -> T:
    """The value of a flag declared `required=True` (None in its declaration only as the not-given marker).

    Validation has rejected a missing one already; a Config built directly (tests) gets the same error here."""
    if value is None:
        raise ConfigError([f"{flag} is required"])
    return value


@section
class Config:
    """The whole run configuration: run-wide settings plus one frozen section per concern.

    Build it with `miles.config.parse_config(argv)` or `Config.from_dict(d)`; both merge, resolve derived
    values and validate. Constructing it directly skips validation (fine for tests of one component).
    """

    seed: int = opt(1234, "global random seed", ge=0)
    dry_run: bool = opt(False, "print the resolved config as YAML and exit")
    config: str | None = opt(None, "YAML file of flag values; merged under the command line")
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def _leaves(self) -> Iterator[tuple[object, dataclasses.Field]]:
        """(owner, field) for every flag-level field: run-wide ones first, then each section's."""
        for f in dataclasses.fields(self):
            if "help" in f.metadata:
                yield self, f
        for f in dataclasses.fields(self):
            if "help" not in f.metadata:
                owner = getattr(self, f.name)
                for g in dataclasses.fields(owner):
                    if not is_derived(g):
                        yield owner, g

    def to_dict(self, redact_secrets: bool = False) -> dict[str, Any]:  # each field's own type; sections nest
        """Plain nested dict: run-wide keys, then `{section: {field: value}}`; lists and dicts are copies.
        Derived values that are no flag (`train.steps_per_rollout`) are left out: `from_dict` derives them again.

        With `redact_secrets`, fields marked secret (API keys) read "<redacted>" (for logs, trackers and files
        on disk; such a dict does not round-trip). Ray actors get the Config object itself, secrets included."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "help" in f.metadata:
                out[f.name] = copy.deepcopy(value)
            else:
                out[f.name] = {
                    g.name: copy.deepcopy(getattr(value, g.name))
                    for g in dataclasses.fields(value)
                    if not is_derived(g)
                }
        if redact_secrets:
            for owner, f in self._leaves():
                if f.metadata.get("secret") and getattr(owner, f.name) is not None:
                    target = out if owner is self else out[_section_name(self, owner)]
                    target[f.name] = "<redacted>"
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Config:
        """Build a validated Config from `to_dict()` output (or any flat/nested mapping of flag names).

        Unset fields take their defaults; derived values are resolved and everything is validated.
        """
        from miles.config.parser import build_config

        return build_config([("from_dict", d)])

    def to_yaml(self, redact_secrets: bool = True) -> str:
        """The resolved config as YAML, nested by section (what `--dry-run` prints).

        Fields marked secret (API keys) print as "<redacted>" unless `redact_secrets=False`.
        """
        import yaml

        return yaml.safe_dump(self.to_dict(redact_secrets), sort_keys=False, default_flow_style=False)

    def unimplemented_flags(self) -> list[str]:
        """`--flag=value` for every not-yet-implemented flag set to a non-default value."""
        found = []
        for owner, f in self._leaves():
            if f.metadata.get("implemented", True):
                continue
            default = field_default(f)
            value = getattr(owner, f.name)
            if value != default:
                found.append(f"--{f.name.replace('_', '-')}={value!r}")
        return found

    def raise_if_unimplemented(self) -> None:
        """Raise NotImplementedError naming every not-yet-implemented flag set to a non-default value."""
        found = self.unimplemented_flags()
        if found:
            raise NotImplementedError(
                "these flags are accepted but not implemented yet: "
                + ", ".join(found)
                + " (see NOT_IMPLEMENTED in miles/config/fields.py)"
            )
