"""Typed, strict pipeline configuration (schema, loader, validation)."""
from roll_gspo.config.errors import ConfigError
from roll_gspo.config.loader import config_to_yaml, load_config, resolve_config_path
from roll_gspo.config.schema import (
    DataArgs, GeneratingArgs, ModelArgs, PipelineConfig, RewardConfig, RoleConfig, StrategyArgs,
    TrainingArgs, ValidationConfig,
)
from roll_gspo.config.preflight import preflight
from roll_gspo.config.validate import validate_config
from roll_gspo.config.plan import RunPlan, build_run_plan, freeze_config  # after validate: plan reads its modules
from roll_gspo.schema.frozen import ReadOnlyConfigError, replaced, thawed

__all__ = [
    "ConfigError", "DataArgs", "GeneratingArgs", "ModelArgs", "PipelineConfig", "RewardConfig",
    "RoleConfig", "StrategyArgs", "TrainingArgs", "ValidationConfig", "config_to_yaml", "load_config",
    "preflight", "resolve_config_path", "validate_config", "RunPlan", "build_run_plan", "freeze_config",
    "ReadOnlyConfigError", "replaced", "thawed",
]
