"""Typed, sectioned configuration. Importing this package does not import torch, ray or transformers.

    cfg = parse_config(argv)            # defaults < --config YAML < command line, validated once
    cfg.rollout.rollout_batch_size      # `--rollout-batch-size`
    cfg.to_yaml() / cfg.to_dict() / Config.from_dict(d)

Modules: `fields` (how a field is declared), `sections` (the declarations), `core` (Config, ConfigError),
`schema` (flag registry, coercion), `values` / `resolve` / `rules` / `validate` (the merged values, derived values,
cross-field rules, the pass that runs them), `parser` (argparse generation, YAML, merge).

Imports nothing from miles.rollout, miles.backends, miles.engines or miles.ray (tests/unit/test_import_rules.py):
checks that need them (SGLang's and sglang-router's parsers, files, rewards) live in `miles.preflight`, whose
`parse_config` the driver calls.
"""

from miles.config.core import Config, ConfigError, required
from miles.config.fields import NOT_IMPLEMENTED
from miles.config.parser import build_parser, parse_config
from miles.config.schema import FIELDS, FieldSpec
from miles.config.sections import (
    SECTIONS,
    AlgoConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EngineConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
)

__all__ = [
    "FIELDS",
    "NOT_IMPLEMENTED",
    "SECTIONS",
    "AlgoConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "FieldSpec",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "RolloutConfig",
    "TrainConfig",
    "build_parser",
    "parse_config",
    "required",
]
