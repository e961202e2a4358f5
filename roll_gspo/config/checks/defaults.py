"""The derived defaults: the schema's null defaults turned into their documented values (models follow
`pretrain`, lengths `response_length`, rollout files under output_dir), and validation turned off where
there is nothing to validate on."""
from __future__ import annotations

import os
from typing import AbstractSet, List, Optional

from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, notice
from roll_gspo.schema.config import PipelineConfig


@check("derive", keys=("<role>.model_args.model_name_or_path", "<role>.generating_args.max_new_tokens",
                       "<role>.generating_args.num_return_sequences", "logging_dir", "loss_norm_length",
                       "validation.data_args.template", "rollout_dump_dir", "validation_data_dir"),
       doc="the schema's null defaults: models follow `pretrain` / `reward_pretrain`, lengths `response_length`, "
           "validation prompts actor_train's template, rollout files under output_dir", name="defaults.derived",
       after=("agentic.defaults",))  # the agentic lengths come from sequence_length first
def _fill_derived(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Turn the schema's null defaults into their documented values, in place."""
    for role in (cfg.actor_train, cfg.actor_infer, cfg.reference):
        role.model_args.model_name_or_path = role.model_args.model_name_or_path or cfg.pretrain
    # Only null means "the default": an explicit 0 stays 0 and is refused by _range_problems.
    gen = cfg.actor_infer.generating_args
    gen.max_new_tokens = _default_if_none(gen.max_new_tokens, cfg.response_length)
    gen.num_return_sequences = _default_if_none(gen.num_return_sequences, cfg.num_return_sequences_in_group)
    val_gen = cfg.validation.generating_args
    val_gen.max_new_tokens = _default_if_none(val_gen.max_new_tokens, cfg.response_length)
    val_gen.num_return_sequences = _default_if_none(val_gen.num_return_sequences, 1)
    cfg.logging_dir = cfg.logging_dir or os.path.join(cfg.output_dir, "tensorboard")
    cfg.rollout_dump_dir = cfg.rollout_dump_dir or os.path.join(cfg.output_dir, "rollouts")
    cfg.validation_data_dir = cfg.validation_data_dir or os.path.join(cfg.rollout_dump_dir, "val")
    cfg.loss_norm_length = _default_if_none(cfg.loss_norm_length, cfg.response_length)
    # ROLL: validation prompts are templated like the training prompts unless they name their own.
    if cfg.validation.data_args.template is None:
        cfg.validation.data_args.template = cfg.actor_train.data_args.template
    for reward in cfg.rewards.values():  # model-based rewards default to `reward_pretrain`
        reward.model_args.model_name_or_path = reward.model_args.model_name_or_path or cfg.reward_pretrain
    return []


def _default_if_none(value, default):
    return default if value is None else value


@check("derive", keys=("eval_steps",), doc="`eval_steps` without validation prompts: validation is off, said "
       "once (as ROLL skips it)", name="defaults.no_validation")
def _no_validation_notice(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """eval_steps without validation prompts: ROLL skips validation then (its judge recipe sets
    eval_steps and no validation block); so does this run, saying so once."""
    if cfg.pipeline != "rlvr" or cfg.eval_steps <= 0 or cfg.validation.data_args.file_name or cfg.tasks:
        return []  # tasks bring their own validation rows; a negative count is refused
    steps, cfg.eval_steps = cfg.eval_steps, 0
    return [notice("eval_steps", f"eval_steps = {steps} is ignored: validation.data_args.file_name is empty, so there "
                                 f"is nothing to validate on (ROLL skips it too); give validation prompts to validate "
                                 f"every {steps} steps")]
