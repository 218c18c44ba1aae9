"""Typed, sectioned configuration. Importing this package does not import torch, ray or transformers.

    cfg = parse_config(argv)            # defaults < --config YAML < command line, validated once
    cfg.rollout.rollout_batch_size      # `--rollout-batch-size`
    cfg.to_yaml() / cfg.to_dict() / Config.from_dict(d)

Modules: `sections` (field declarations), `core` (Config, ConfigError), `schema` (flag registry, coercion),
`validate` (derived values and rules), `parser` (argparse generation, YAML, merge).
"""

from miles.config.core import Config, ConfigError, required
from miles.config.parser import build_parser, parse_config
from miles.config.schema import FIELDS, FieldSpec
from miles.config.sections import (
    NOT_IMPLEMENTED,
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
