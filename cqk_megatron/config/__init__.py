"""The run configuration, torch-free: ``schema`` (the dataclasses, the one source of truth),
``load`` (YAML files, ``include:`` and ``key=value`` overrides, and where each value came
from), ``checks`` (``validate()``) and ``changes`` (what differs between two configs).
Import from here: ``from cqk_megatron.config import RunConfig, load_config, validate``."""

from __future__ import annotations

from cqk_megatron.config.checks import (
    Hardware,
    StatedHardware,
    ThisMachine,
    check_fault_bounds,
    config_errors,
    hardware_errors,
    validate,
)
from cqk_megatron.config.load import (
    COMMAND_LINE,
    TracedConfig,
    apply_model_family,
    apply_overrides,
    explain_config,
    load_config,
    load_config_traced,
    load_yaml_dict,
    read_yaml,
    save_config,
    variant_preset,
)
from cqk_megatron.config.schema import (
    CONFIGS_DIR,
    MODEL_FAMILIES,
    POSITION_EMBEDDINGS,
    RECOMPUTE,
    RECOMPUTE_METHODS,
    AttentionConfig,
    CardConfig,
    ConfigError,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    family_overrides,
    flatten,
    from_dict,
    to_dict,
)

# train.optimizer_checkpoint's choices: the Megatron engine's setting
from cqk_megatron.training.engines.megatron_spec import OPTIMIZER_CHECKPOINTS

# the registry's live views of variant names, as the config knows them
from cqk_megatron.variants import COUPLINGS, SCORINGS, VARIANTS

__all__ = [
    "AttentionConfig",
    "COMMAND_LINE",
    "CONFIGS_DIR",
    "COUPLINGS",
    "CardConfig",
    "ConfigError",
    "DataConfig",
    "Hardware",
    "LogConfig",
    "MODEL_FAMILIES",
    "ModelConfig",
    "OPTIMIZER_CHECKPOINTS",
    "POSITION_EMBEDDINGS",
    "ParallelConfig",
    "RECOMPUTE",
    "RECOMPUTE_METHODS",
    "RunConfig",
    "SCORINGS",
    "StatedHardware",
    "ThisMachine",
    "TracedConfig",
    "TrainConfig",
    "VARIANTS",
    "apply_model_family",
    "apply_overrides",
    "check_fault_bounds",
    "config_errors",
    "explain_config",
    "family_overrides",
    "flatten",
    "from_dict",
    "hardware_errors",
    "load_config",
    "load_config_traced",
    "load_yaml_dict",
    "read_yaml",
    "save_config",
    "to_dict",
    "validate",
    "variant_preset",
]
