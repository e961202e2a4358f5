"""`validate_config`, which runs every registered config step (`registry`), and the steps that
belong to no one feature: the run's derived defaults, ranges, batch arithmetic, the policy's
engines, and warnings for the GSPO traps of gspo.md. A feature's steps live in the module that owns
its keys (agentic_checks, critic_checks, lora, async_rollout, reward_checks, placement_checks, ...);
what the config names outside itself is `preflight`'s.
"""
from __future__ import annotations

import logging
import os
from typing import AbstractSet, List, Optional

from roll_gspo.catalog import engines
from roll_gspo.catalog.estimators import ESTIMATORS
from roll_gspo.catalog.policy_losses import LOSS_SPECS, canonical_loss
from roll_gspo.config.plan.engine_logprobs import rollout_logprobs_are_exact, rollout_logprobs_bias, vllm_dtype_name
from roll_gspo.config.findings import Finding, error, notice, warning
from roll_gspo.config.checks.registry import check, run_steps
from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source
from roll_gspo.config.plan.correction import correction_enabled
from roll_gspo.config.plan.vllm_prefill import prompt_split_problems
from roll_gspo.schema.config import GeneratingArgs, PipelineConfig, RoleConfig

logger = logging.getLogger("roll_gspo.config")
# vLLM's `generation_config` value that takes no sampling defaults from the model folder (what
# roll_gspo sets): sampling comes from generating_args alone.
VLLM_OWN_DEFAULTS = "vllm"

# A sequence ratio is a geometric mean of token ratios and stays within ~1e-3 of 1; a clip range
# wider than this essentially never fires under importance_sampling: seq.
SEQ_CLIP_WARN_ABOVE = 5e-3
# More optimizer steps than this per rollout: the later mini-batches train on responses of a
# policy many steps old, where a GSPO-sized clip zeroes most of their gradient.
MANY_OPTIMIZER_STEPS_PER_ROLLOUT = 16


@check("derive", keys=("<role>.model_args.model_name_or_path", "<role>.generating_args.max_new_tokens",
                       "<role>.generating_args.num_return_sequences", "logging_dir", "loss_norm_length",
                       "validation.data_args.template", "rollout_dump_dir", "validation_data_dir"),
       doc="the schema's null defaults: models follow `pretrain` / `reward_pretrain`, lengths `response_length`, "
           "validation prompts actor_train's template, rollout files under output_dir", name="validate.defaults",
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


def _generating_problems(gen: GeneratingArgs, key: str) -> List[Finding]:
    problems = []
    if gen.temperature < 0:
        problems.append(error(f"{key}.temperature",
                              f"{key}.temperature: must be >= 0 (0 is greedy), got {gen.temperature}"))
    if not 0 < gen.top_p <= 1:
        problems.append(error(f"{key}.top_p",
                              f"{key}.top_p: must be in (0, 1] (1 keeps the whole distribution), got {gen.top_p}"))
    if gen.top_k < -1:
        problems.append(error(f"{key}.top_k",
                              f"{key}.top_k: must be -1 or 0 (off) or a positive count, got {gen.top_k}"))
    for name in ("max_new_tokens", "num_return_sequences"):
        if getattr(gen, name) < 1:
            problems.append(error(f"{key}.{name}",
                                  f"{key}.{name}: must be >= 1 (null means the default), got {getattr(gen, name)}"))
    return problems


@check("check", keys=("rollout_dump_samples", "kl_loss_coef", "init_kl_coef", "weight_sync_bucket_mb",
                      "weight_sync_timeout_s",
                      "loss_norm_length", "actor_train.training_args", "<role>.generating_args"),
       doc="ranges: `rollout_dump_samples` below -1, negative `kl_loss_coef`, `init_kl_coef`, learning rate, "
           "`warmup_steps`, `max_grad_norm`, "
           "`weight_decay`; `adam_beta1/2` outside [0, 1); weight-sync bucket or timeout <= 0; `temperature` < 0, "
           "`top_p` outside (0, 1], `top_k` < -1; an explicit 0 for `max_new_tokens`, `num_return_sequences` or "
           "`loss_norm_length` (only null means the default)", name="validate.ranges")
def _range_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Values outside the range where the key means anything (accepted silently before)."""
    problems = []
    for key in ("kl_loss_coef", "init_kl_coef"):
        if getattr(cfg, key) < 0:
            problems.append(error(key, f"{key}: must be >= 0 (a negative coefficient rewards moving away from the "
                                       f"reference), got {getattr(cfg, key)}"))
    if cfg.rollout_dump_samples < -1:
        problems.append(error("rollout_dump_samples", f"rollout_dump_samples: must be >= -1 (-1: every sample, 0: "
                                                      f"none), got {cfg.rollout_dump_samples}"))
    if cfg.weight_sync_bucket_mb <= 0:
        problems.append(error("weight_sync_bucket_mb",
                              f"weight_sync_bucket_mb: must be > 0, got {cfg.weight_sync_bucket_mb}"))
    if cfg.weight_sync_timeout_s <= 0:
        problems.append(error("weight_sync_timeout_s",
                              f"weight_sync_timeout_s: must be > 0, got {cfg.weight_sync_timeout_s}"))
    if (cfg.loss_norm_length or 0) < 1:  # filled by the derive phase: null became response_length
        problems.append(error("loss_norm_length",
                              f"loss_norm_length: must be >= 1 (null means response_length), got "
                              f"{cfg.loss_norm_length}"))
    args = cfg.actor_train.training_args
    for name, low in (("learning_rate", 0), ("warmup_steps", 0), ("max_grad_norm", 0), ("weight_decay", 0)):
        if getattr(args, name) < low:
            problems.append(error(f"actor_train.training_args.{name}",
                                  f"actor_train.training_args.{name}: must be >= {low}, got {getattr(args, name)}"))
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            problems.append(error(f"actor_train.training_args.{name}",
                                  f"actor_train.training_args.{name}: must be in [0, 1), got {getattr(args, name)}"))
    if cfg.pipeline == "agentic":
        for key in ("train_env_manager", "val_env_manager"):
            problems += _generating_problems(getattr(cfg, key).generating_args, f"{key}.generating_args")
    if cfg.has_rollout():
        problems += _generating_problems(cfg.actor_infer.generating_args, "actor_infer.generating_args")
        problems += _generating_problems(cfg.validation.generating_args, "validation.generating_args")
    return problems


@check("check", keys=("rollout_batch_size", "<role>.world_size", "<role>.num_cpus_per_worker", "max_steps"),
       doc="counts and sizes below 1 (batch sizes, lengths, world sizes, steps), negative step counts, CPU "
           "reservations and reward timeouts <= 0", name="validate.counts")
def _positive(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    problems = []
    checks = {
        "rollout_batch_size": cfg.rollout_batch_size, "num_return_sequences_in_group": cfg.num_return_sequences_in_group,
        "prompt_length": cfg.prompt_length, "response_length": cfg.response_length, "ppo_epochs": cfg.ppo_epochs,
        "model_update_frequency": cfg.model_update_frequency, "logging_steps": cfg.logging_steps,
    }
    for name in ("actor_train", "actor_infer", "reference"):
        role: RoleConfig = getattr(cfg, name)
        checks[f"{name}.world_size"] = role.world_size
        checks[f"{name}.infer_batch_size"] = role.infer_batch_size
        checks[f"{name}.training_args.per_device_train_batch_size"] = role.training_args.per_device_train_batch_size
        checks[f"{name}.training_args.gradient_accumulation_steps"] = role.training_args.gradient_accumulation_steps
    for domain, reward in cfg.rewards.items():
        checks[f"rewards.{domain}.world_size"] = reward.world_size
    for key, value in checks.items():
        if value < 1:
            problems.append(error(key, f"{key}: must be >= 1, got {value}"))
    for key in ("max_steps", "save_steps", "eval_steps", "save_total_limit"):
        if getattr(cfg, key) < 0:
            problems.append(error(key, f"{key}: must be >= 0, got {getattr(cfg, key)}"))
    for name in ("actor_train", "actor_infer", "reference"):
        if getattr(cfg, name).num_cpus_per_worker <= 0:
            problems.append(error(f"{name}.num_cpus_per_worker", f"{name}.num_cpus_per_worker: must be > 0 (fractions "
                                                                 f"are fine), got "
                                                                 f"{getattr(cfg, name).num_cpus_per_worker}"))
    for domain, reward in cfg.rewards.items():
        if reward.num_cpus_per_worker <= 0:
            problems.append(error(f"rewards.{domain}.num_cpus_per_worker",
                                  f"rewards.{domain}.num_cpus_per_worker: must be > 0, got "
                                  f"{reward.num_cpus_per_worker}"))
        if reward.timeout_s <= 0:
            problems.append(error(f"rewards.{domain}.timeout_s",
                                  f"rewards.{domain}.timeout_s: must be > 0, got {reward.timeout_s}"))
    return problems


def _quoted(names: List[str]) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _model_key(name: Optional[str]) -> str:
    name = name or ""  # filled by the derive phase (null follows `pretrain`)
    return name if name.startswith("builtin:") else os.path.realpath(os.path.expanduser(name))


@check("check", keys=("<role>.model_args.model_name_or_path", "<role>.model_args.dtype",
                      "actor_infer.strategy_args.strategy_config", "old_logprob_source"),
       doc="one policy, one precision, enough room: actor_infer's model differing from actor_train's (or a vLLM "
           "`model`), a vLLM `dtype` or DeepSpeed `bf16`/`fp16.enabled` contradicting `model_args.dtype`, a vLLM "
           "`max_model_len` below prompt_length + response_length, a `tensor_parallel_size` above the rank's "
           "reservation, prompts split on CPU, sampling from the model folder's generation_config, "
           "`old_logprob_source: rollout` where vLLM's log-probs are not the trainer's", name="validate.engines")
def _model_and_engine_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """The rollout engine must run the trained policy, in its dtype, with room for the lengths,
    sampling from generating_args only; DeepSpeed's precision must be model_args.dtype."""
    if not cfg.has_rollout():
        return []
    problems: List[Finding] = []
    train_model = cfg.actor_train.model_args.model_name_or_path
    infer_model = cfg.actor_infer.model_args.model_name_or_path
    if _model_key(train_model) != _model_key(infer_model):
        problems.append(error("actor_infer.model_args.model_name_or_path",
                              f"actor_infer.model_args.model_name_or_path = {infer_model!r} differs from "
                              f"actor_train.model_args.model_name_or_path = {train_model!r}: they must be the same "
                              f"policy (weight sync overwrites the rollout model after step 1, and step 1 samples from "
                              f"the other one). Leave both null to follow `pretrain`, or name the same folder"))
    for role_name in ("actor_train", "reference"):
        role = getattr(cfg, role_name)
        if role.strategy_args.strategy_name not in ("deepspeed_train", "deepspeed_infer") or (
                role_name == "reference" and not cfg.needs_reference()):
            continue
        for ds_key, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
            section = role.strategy_args.strategy_config.get(ds_key)
            enabled = section.get("enabled") if isinstance(section, dict) else None
            if enabled is None or enabled == "auto":
                continue
            if bool(enabled) != (role.model_args.dtype == dtype):
                problems.append(error(f"{role_name}.strategy_args.strategy_config.{ds_key}.enabled",
                                      f"{role_name}.strategy_args.strategy_config.{ds_key}.enabled = {enabled} "
                                      f"contradicts {role_name}.model_args.dtype = {role.model_args.dtype}; roll_gspo "
                                      f"fills DeepSpeed's bf16/fp16 sections from model_args.dtype: set the dtype "
                                      f"there and drop {ds_key}"))
    infer = cfg.actor_infer
    if not infer.strategy_args.engine.vllm_engine_args:
        return problems
    engine = infer.strategy_args.strategy_config
    key = "actor_infer.strategy_args.strategy_config"
    from roll_gspo.placement.device_mapping import tensor_parallel_problems

    problems += [error(k, message) for k, message in tensor_parallel_problems(infer)]
    if "dtype" in engine and vllm_dtype_name(engine["dtype"]) != infer.model_args.dtype:
        problems.append(error(f"{key}.dtype", f"{key}.dtype = {engine['dtype']!r} contradicts "
                                              f"actor_infer.model_args.dtype = {infer.model_args.dtype!r}; the rollout "
                                              f"dtype is set by model_args.dtype only (drop the engine's dtype or make "
                                              f"it agree)"))
    if "model" in engine and _model_key(str(engine["model"])) != _model_key(infer_model):
        problems.append(error(f"{key}.model", f"{key}.model = {engine['model']!r}: the rollout model is "
                                              f"actor_infer.model_args.model_name_or_path ({infer_model!r}); drop the "
                                              f"engine's model"))
    needed = cfg.max_sequence_tokens()
    if isinstance(engine.get("max_model_len"), int) and engine["max_model_len"] < needed:
        problems.append(error(f"{key}.max_model_len", f"{key}.max_model_len = {engine['max_model_len']} is less than "
                                                      f"prompt_length + response_length = {cfg.prompt_length} + "
                                                      f"{cfg.response_length} = {needed}: vLLM would refuse long "
                                                      f"prompts or cut responses short; raise it to {needed} or drop "
                                                      f"it (the default)"))
    if not (infer.num_gpus_per_worker or infer.device_mapping is not None):  # vLLM on CPU: prompts admitted whole
        length = engine["max_model_len"] if isinstance(engine.get("max_model_len"), int) else needed
        problems += [error(key, p) for p in prompt_split_problems(engine, length, key)]
    if engine.get("generation_config", VLLM_OWN_DEFAULTS) != VLLM_OWN_DEFAULTS or engine.get("override_generation_config"):
        problems.append(error(f"{key}.generation_config", f"{key}.generation_config / override_generation_config: "
                                                          f"sampling comes from actor_infer.generating_args only "
                                                          f"(roll_gspo sets generation_config: vllm so nothing is "
                                                          f"taken from the model folder); set the sampling keys in "
                                                          f"generating_args and drop these"))
    bias = rollout_logprobs_bias(cfg)
    if bias and cfg.old_logprob_source == "rollout":
        problems.append(error("old_logprob_source", f"old_logprob_source: rollout would bias every importance ratio: "
                                                    f"{bias}; or use old_logprob_source: trainer (or auto, the "
                                                    f"default, which takes the trainer's here)"))
    return problems


@check("check", keys=("rollout_batch_size", "adv_estimator", "reward_norm", "pg_clip_low", "pg_clip_high",
                      "<role>.strategy_args.strategy_name", "<role>.generating_args.max_new_tokens",
                      "actor_train.data_args.file_name"),
       doc="batch arithmetic (responses per step not divisible by the mini-batch), estimators that need groups or "
           "turns, a `reward_norm` over sets of one response (every reward 0), contradictory reward and clip keys, "
           "`max_new_tokens` above `response_length`, strategy names a role cannot run, no training prompts",
       name="validate.algorithm", rollout_only=True)
def _algorithm_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    problems: List[Finding] = []
    group = cfg.num_return_sequences_in_group
    batch = cfg.rollout_batch_size * group
    mini = cfg.mini_batch_size()
    args = cfg.actor_train.training_args
    rlvr = cfg.pipeline == "rlvr"  # the agentic pipeline checks its own batch, groups and data (agentic_checks)
    if rlvr and batch % mini:
        problems.append(error("rollout_batch_size", 
            f"batch arithmetic: rollout_batch_size * num_return_sequences_in_group = "
            f"{cfg.rollout_batch_size} * {group} = {batch} responses per step is not divisible by the "
            f"mini-batch actor_train.training_args.per_device_train_batch_size * "
            f"gradient_accumulation_steps * actor_train.world_size = {args.per_device_train_batch_size} "
            f"* {args.gradient_accumulation_steps} * {cfg.actor_train.world_size} = {mini}"))
    if cfg.moe_aux_loss_coef < 0:
        problems.append(error("moe_aux_loss_coef",
                              f"moe_aux_loss_coef must be >= 0 (0: off), got {cfg.moe_aux_loss_coef}"))
    if cfg.old_logprob_auto_max_gap is not None and cfg.old_logprob_auto_max_gap < 0:
        problems.append(error("old_logprob_auto_max_gap", f"old_logprob_auto_max_gap must be >= 0 (0: never switch; "
                                                          f"null: pg_clip_low / 10), got "
                                                          f"{cfg.old_logprob_auto_max_gap}"))
    if cfg.router_replay and cfg.old_logprob_source == "rollout":
        problems.append(error("router_replay", "router_replay: true replays the experts recorded while the trainer "
                                               "computes the old log-probs; it needs old_logprob_source: trainer (or "
                                               "auto, the default)"))
    estimator = ESTIMATORS.get(cfg.adv_estimator)
    if rlvr and estimator is not None and "rlvr" not in estimator.pipelines:  # step_reinforce: turn credit
        problems.append(error("adv_estimator", f"adv_estimator {cfg.adv_estimator!r} credits the turns of multi-turn "
                                               f"episodes (pipeline: agentic); a single-turn response has one turn, "
                                               f"where it is `reinforce`: use that"))
    if rlvr and estimator is not None and group < estimator.min_group:
        problems.append(error("adv_estimator", f"adv_estimator {cfg.adv_estimator!r} needs "
                                               f"num_return_sequences_in_group >= 2 (a group baseline of one response "
                                               f"is the response itself), got {group}"))
    if cfg.reward_shift and cfg.reward_scale:
        problems.append(error("reward_shift", "reward_shift and reward_scale are both true: contradictory (shift only "
                                              "subtracts the mean, scale only divides by the std; set both false for a "
                                              "full z-score)"))
    if not 0 <= cfg.pg_clip_low < 1:
        problems.append(error("pg_clip_low", f"pg_clip_low: must be in [0, 1), got {cfg.pg_clip_low}"))
    if cfg.pg_clip_high < 0:
        problems.append(error("pg_clip_high", f"pg_clip_high: must be >= 0, got {cfg.pg_clip_high}"))
    if cfg.dual_clip_loss and cfg.dual_clip_c <= 1:
        problems.append(error("dual_clip_c",
                              f"dual_clip_c: must be > 1 when dual_clip_loss is true, got {cfg.dual_clip_c}"))
    for key in ("reward_clip", "advantage_clip"):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            problems.append(error(key, f"{key}: must be > 0 or null, got {value}"))
    gen = cfg.actor_infer.generating_args
    if gen.num_return_sequences != group:
        problems.append(error("actor_infer.generating_args.num_return_sequences",
                              f"actor_infer.generating_args.num_return_sequences = {gen.num_return_sequences} "
                              f"contradicts num_return_sequences_in_group = {group}; leave it null"))
    for key, generating in (("actor_infer", gen), ("validation", cfg.validation.generating_args)) if rlvr else ():
        if (generating.max_new_tokens or 0) > cfg.response_length:  # null was filled by the derive phase
            problems.append(error(f"{key}.generating_args.max_new_tokens",
                                  f"{key}.generating_args.max_new_tokens = {generating.max_new_tokens} exceeds "
                                  f"response_length = {cfg.response_length}"))
    if rlvr and cfg.reward_norm in ("group", "batch"):
        size = group if cfg.reward_norm == "group" else batch
        if size < 2:
            problems.append(error("reward_norm", f"reward_norm: {cfg.reward_norm} over sets of {size} response "
                                                 f"(num_return_sequences_in_group = {group}, rollout_batch_size = "
                                                 f"{cfg.rollout_batch_size}) turns every reward into 0; use "
                                                 f"reward_norm: null, or more responses per {cfg.reward_norm}"))
    if "actor_train" not in cfg.actor_train.strategy_args.engine.roles:
        problems.append(error("actor_train.strategy_args.strategy_name",
                              f"actor_train.strategy_args.strategy_name: must be {_quoted(engines.names('actor_train'))}, "
                              f"got {cfg.actor_train.strategy_args.strategy_name!r}"))
    if "actor_infer" not in cfg.actor_infer.strategy_args.engine.roles:
        problems.append(error("actor_infer.strategy_args.strategy_name",
                              f"actor_infer.strategy_args.strategy_name: must be {_quoted(engines.names('actor_infer'))}, "
                              f"got {cfg.actor_infer.strategy_args.strategy_name!r}"))
    if cfg.needs_reference() and "reference" not in cfg.reference.strategy_args.engine.roles:
        problems.append(error("reference.strategy_args.strategy_name",
                              f"reference.strategy_args.strategy_name: must be {_quoted(engines.names('reference'))} "
                              f"(the training engines build frozen), got {cfg.reference.strategy_args.strategy_name!r}"))
    if rlvr and not cfg.actor_train.data_args.file_name and not cfg.tasks:
        problems.append(error("actor_train.data_args.file_name",
                              "actor_train.data_args.file_name: no training prompts given (nor `tasks`)"))
    stage = cfg.actor_train.strategy_args.strategy_config.get("zero_optimization", {}).get("stage", 0)
    if cfg.actor_train.strategy_args.strategy_name == "deepspeed_train" and stage not in (0, 1, 2, 3):
        problems.append(error("actor_train.strategy_args.strategy_config.zero_optimization.stage",
                              f"actor_train.strategy_args.strategy_config.zero_optimization.stage: must be 0, 1, 2 or "
                              f"3, got {stage!r}"))
    return problems


@check("check", keys=("<role>.use_dynamic_batching_in_train", "<role>.max_tokens_per_microbatch_in_train",
                      "<role>.sequence_length_round_in_train"),
       doc="dynamic batching on a role whose passes it does not split, or with a token budget below one "
           "whole sequence", name="validate.dynamic_batching")
def _dynamic_batching_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Token-budget micro-batches: a budget that holds one whole sequence, and the keys only on
    roles whose passes they split (actor_train: train and infer; reference: infer)."""
    problems = []
    longest = cfg.max_sequence_tokens()
    readers = {"actor_train": ("train", "infer"), "reference": ("infer",), "actor_infer": ()}
    for name, phases in readers.items():
        role: RoleConfig = getattr(cfg, name)
        for phase in ("train", "infer"):
            on, budget = getattr(role, f"use_dynamic_batching_in_{phase}"), getattr(role, f"max_tokens_per_microbatch_in_{phase}")
            rounding = getattr(role, f"sequence_length_round_in_{phase}")
            if on and phase not in phases:
                why = ("vLLM schedules its own batches by tokens (max_num_batched_tokens in "
                       "actor_infer.strategy_args.strategy_config)" if name == "actor_infer"
                       else "the reference is frozen: it only runs log-prob passes (use_dynamic_batching_in_infer)")
                problems.append(error(f"{name}.use_dynamic_batching_in_{phase}",
                                      f"{name}.use_dynamic_batching_in_{phase}: nothing reads it: {why}"))
            if not on:
                continue
            if not budget or budget < longest:
                problems.append(error(f"{name}.max_tokens_per_microbatch_in_{phase}",
                                      f"{name}.max_tokens_per_microbatch_in_{phase} = {budget}: with "
                                      f"use_dynamic_batching_in_{phase} it must be set to at least one whole sequence, "
                                      f"{'sequence_length' if cfg.pipeline == 'agentic' else 'prompt_length + response_length'} "
                                      f"= {longest} tokens"))
            if rounding < 1:
                problems.append(error(f"{name}.sequence_length_round_in_{phase}",
                                      f"{name}.sequence_length_round_in_{phase}: must be >= 1, got {rounding}"))
    return problems


@check("check", keys=("actor_train.data_args.file_name",), doc="sft: no SFT data", name="validate.sft_data")
def _sft_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if cfg.has_rollout() or cfg.actor_train.data_args.file_name:
        return []
    return [error("actor_train.data_args.file_name", "actor_train.data_args.file_name: no SFT data given")]


@check("warn", keys=("ppo_epochs", "pg_clip_low", "pg_clip_high", "importance_sampling", "reward_shift",
                     "use_kl_loss", "old_logprob_source", "model_update_frequency"),
       doc="the GSPO traps: more than 16 or exactly one optimizer step per rollout, a token-sized clip with "
           "sequence ratios (or the reverse), KL applied twice, stale rollouts (`model_update_frequency` > 1) "
           "uncorrected, rollout log-probs with token ratios or outside fp32", name="validate.gspo_traps", rollout_only=True)
def _warn_traps(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    warns: List[Finding] = []
    batch = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    mini = cfg.mini_batch_size()
    clip = max(cfg.pg_clip_low, cfg.pg_clip_high)
    if cfg.ppo_epochs * (batch // max(mini, 1)) == 1:
        warns.append(warning("ppo_epochs", 
            f"one optimizer step per rollout (ppo_epochs = 1 and the whole batch of {batch} is one "
            f"mini-batch): the importance ratio is exactly 1 at that step, clipping never fires and "
            f"GSPO degenerates to plain policy gradient. Lower gradient_accumulation_steps or "
            f"per_device_train_batch_size to get several mini-batches (the GSPO paper uses 4)."))
    loss = LOSS_SPECS[canonical_loss(cfg.policy_loss)]
    # The clip's size against the ratio's level matters only to a loss that clips the ratio itself.
    ratio_clipped = loss.reads_clip and not loss.clip_in_log_space
    if ratio_clipped and cfg.importance_sampling in ("seq", "gspo-token") and clip > SEQ_CLIP_WARN_ABOVE:
        warns.append(warning("importance_sampling", 
            f"importance_sampling: {cfg.importance_sampling} with a token-sized clip range "
            f"(pg_clip_low={cfg.pg_clip_low}, pg_clip_high={cfg.pg_clip_high}): sequence ratios stay "
            f"within ~1e-3 of 1, so this almost never clips. The GSPO paper uses 3e-4 / 4e-4."))
    if ratio_clipped and cfg.importance_sampling == "token" and clip < 1e-2:
        warns.append(warning("importance_sampling", f"importance_sampling: token with a sequence-sized clip range "
                                                    f"({clip}): most tokens will be clipped; PPO/GRPO use about 0.2."))
    if cfg.reward_norm is None and (cfg.reward_shift or cfg.reward_scale):
        warns.append(warning("reward_norm", "reward_shift / reward_scale have no effect while reward_norm is null"))
    if cfg.use_kl_loss and cfg.add_token_level_kl:
        warns.append(warning("use_kl_loss", "use_kl_loss and add_token_level_kl are both on: KL is penalised twice"))
    if (cfg.old_logprob_source == "rollout" and cfg.importance_sampling == "token"
            and not rollout_logprobs_are_exact(cfg)[0]):  # fp32 on both sides: ~1e-6 a token, nothing to warn of
        warns.append(warning("old_logprob_source", "old_logprob_source: rollout with token-level ratios outside "
                                                   "fp32: the engines' per-token precision mismatch enters every "
                                                   "ratio; GSPO's sequence ratio averages it out"))
    steps = cfg.ppo_epochs * (batch // max(mini, 1))
    if steps > MANY_OPTIMIZER_STEPS_PER_ROLLOUT:
        args = cfg.actor_train.training_args
        wanted = batch // 4
        warns.append(warning("ppo_epochs", 
            f"{steps} optimizer steps per rollout: ppo_epochs * rollout_batch_size * num_return_sequences_in_group "
            f"/ (actor_train.training_args.per_device_train_batch_size * gradient_accumulation_steps * "
            f"actor_train.world_size) = {cfg.ppo_epochs} * {cfg.rollout_batch_size} * {cfg.num_return_sequences_in_group}"
            f" / ({args.per_device_train_batch_size} * {args.gradient_accumulation_steps} * "
            f"{cfg.actor_train.world_size}) = {steps}. By the later mini-batches the policy has taken up to "
            f"{steps - 1} steps since it sampled their responses, so their ratios leave the clip range "
            f"(pg_clip_low / pg_clip_high = {cfg.pg_clip_low} / {cfg.pg_clip_high}) and give no gradient: most "
            f"of the rollout is wasted. The GSPO paper takes 4 steps per rollout, i.e. a mini-batch of {wanted} "
            f"responses (raise gradient_accumulation_steps or per_device_train_batch_size)."))
    if cfg.model_update_frequency > 1 and not correction_enabled(cfg):  # its weights pi_old / pi_rollout correct it
        k = cfg.model_update_frequency
        source = choose_old_logprob_source(cfg).source  # auto takes the trainer's here
        measured = ("the current trainer weights at the start of each step, not the older weights that sampled: "
                    "the staleness is neither corrected nor clipped" if source == "trainer" else
                    "the stale rollout weights, so it starts far from 1 and a GSPO-sized clip zeroes most gradients")
        warns.append(warning("model_update_frequency", 
            f"model_update_frequency = {k}: the rollout engine gets new weights every {k} steps, so up to {k - 1} "
            f"of every {k} rollouts are sampled by weights up to {k - 1} updates old (off-policy), and nothing "
            f"corrects for it. With old_logprob_source: {source} the importance ratio measures the "
            f"policy's change from {measured}. Use 1 unless you accept that, or turn on train_infer_correction "
            f"(its weights pi_old / pi_rollout then correct for the stale sampler)."))
    engine = cfg.actor_infer.strategy_args.strategy_config
    if (cfg.actor_infer.strategy_args.engine.logprobs_modes and "logprobs_mode" in engine
            and cfg.old_logprob_source != "rollout"):
        warns.append(warning("actor_infer.strategy_args.strategy_config.logprobs_mode",
                             f"actor_infer.strategy_args.strategy_config.logprobs_mode = {engine['logprobs_mode']!r} "
                             f"only changes the logged rollout/logprob_gap (old log-probs come from the trainer); "
                             f"without it roll_gspo picks the mode that matches the trainer's log-probs"))
    if cfg.actor_infer.model_args.dtype != "fp32" and cfg.old_logprob_source == "rollout":
        warns.append(warning("old_logprob_source", f"old_logprob_source: rollout with actor_infer dtype "
                                                   f"{cfg.actor_infer.model_args.dtype}: rollout log-probs may be far "
                                                   f"from the trainer's"))
    return warns


@check("derive", keys=("eval_steps",), doc="`eval_steps` without validation prompts: validation is off, said "
       "once (as ROLL skips it)", name="validate.no_validation")
def _no_validation_notice(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """eval_steps without validation prompts: ROLL skips validation then (its judge recipe sets
    eval_steps and no validation block); so does this run, saying so once."""
    if cfg.pipeline != "rlvr" or cfg.eval_steps <= 0 or cfg.validation.data_args.file_name or cfg.tasks:
        return []  # tasks bring their own validation rows; a negative count is refused
    steps, cfg.eval_steps = cfg.eval_steps, 0
    return [notice("eval_steps", f"eval_steps = {steps} is ignored: validation.data_args.file_name is empty, so there "
                                 f"is nothing to validate on (ROLL skips it too); give validation prompts to validate "
                                 f"every {steps} steps")]


def validate_config(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    """Run every registered step (normalise, derive, check, settle, warn: `registry`): fill derived
    defaults, raise ConfigError listing every problem, log and return the warnings and notices.

    `yaml_keys`: dotted paths the YAML writes (the loader passes them); a key never read by its
    role is refused only when written there. None: every key that differs from its default counts.
    """
    warns = [finding.text for finding in check_config(cfg, yaml_keys)]
    for message in warns:
        logger.warning(message)
    return warns


def check_config(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """`validate_config`'s findings, not logged: ConfigError (its `findings`) on any error, else
    the warnings and notices."""
    return run_steps(cfg, yaml_keys)
