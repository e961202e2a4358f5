"""The policy's shape, read from its config before anything is built (the memory plans and
`memory_allocator: auto` use it)."""
from __future__ import annotations

from typing import Optional

from roll_gspo.placement.memory import ModelShape, shape_of_model_folder
from roll_gspo.schema.config import PipelineConfig, install_policy_size_reader


def policy_shape(cfg: PipelineConfig) -> Optional[ModelShape]:
    """The policy's shape (actor_train's model): its folder's config.json, or a built-in's
    registered config (known before it is built); None when neither says."""
    return model_shape(cfg.actor_train.model_args.model_name_or_path or "")


def model_shape(name: str) -> Optional[ModelShape]:
    """A model's shape by its name: a built-in's registered config or a folder's config.json; None
    when neither says."""
    if name.startswith("builtin:"):
        from roll_gspo.builtin.models import builtin_model_config

        config = builtin_model_config(name)
        return ModelShape.from_hf_config(config) if config else None
    return shape_of_model_folder(name)


def policy_parameters(cfg: PipelineConfig) -> Optional[int]:
    """The policy's parameter count when its shape is known (`PipelineConfig.policy_parameters`)."""
    shape = policy_shape(cfg)
    return shape.num_parameters() if shape else None


install_policy_size_reader(policy_parameters)
