"""Configuration: frozen dataclasses (`schema`), YAML + override loading (`load`), and which
differences make two model configs different models (`diff`)."""

from k3jax.config.diff import EXECUTION_KEYS, model_changes
from k3jax.config.errors import ConfigError
from k3jax.config.load import config_from_dict, config_to_dict, diff_configs, dump_config, load_config, with_overrides
from k3jax.config.pattern import MIXERS, parse_layer_pattern
from k3jax.config.schema import (AttentionConfig, CheckpointConfig, Config, DataConfig, DataSourceConfig,
                                 DistributedConfig,
                                 KDAConfig, LoggingConfig, MeshConfig, MLAConfig, ModelConfig, MoEConfig,
                                 OptimizerConfig, TrainConfig, replace)

__all__ = [
    "AttentionConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DataSourceConfig",
    "DistributedConfig", "EXECUTION_KEYS",
    "KDAConfig", "LoggingConfig", "MeshConfig", "MLAConfig", "MIXERS", "ModelConfig", "MoEConfig",
    "OptimizerConfig", "TrainConfig", "config_from_dict", "config_to_dict", "diff_configs", "dump_config",
    "load_config", "model_changes", "parse_layer_pattern", "replace", "with_overrides",
]
