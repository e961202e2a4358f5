"""Semantic checks of a typed config: batch arithmetic, contradictions, derived defaults, and
warnings for the GSPO traps of gspo.md. Checks that belong to one concept live beside it and are
called from here (device mapping: `roll_gspo.placement.device_mapping`, colocation:
`roll_gspo.placement.colocation`); what the config names outside itself is `preflight`'s.
"""
from __future__ import annotations

import logging
import os
from typing import AbstractSet, List, Optional

from roll_gspo.config import roll_compat
from roll_gspo.config.agentic_checks import (AGENTIC_TEMPLATE_KEYS, agentic_notices, agentic_problems,
    agentic_keys_in_other_pipelines, fill_agentic_defaults, fill_agentic_ratio, infer_agentic_pipeline)
from roll_gspo.config.errors import ConfigError
from roll_gspo.config.role_reads import ignored_key_notices, unread_key_problems
from roll_gspo.config.rollout_logprobs import (choose_old_logprob_source, correction_enabled,
    rollout_correction_problems, rollout_logprobs_bias, vllm_dtype_name)
from roll_gspo.config.fsdp2_config import fsdp2_notices, fsdp2_problems
from roll_gspo.config.lora import lora_problems, lora_warnings
from roll_gspo.config.critic_checks import critic_problems, fill_critic_defaults
from roll_gspo.config.task_checks import task_problems
from roll_gspo.config.vllm_prefill import prompt_split_problems
from roll_gspo.config.schema import AGENTIC_ONLY_ESTIMATORS, FROZEN_STRATEGIES, TRAIN_STRATEGIES, GeneratingArgs, PipelineConfig, RoleConfig
from roll_gspo.placement.device_mapping import device_mapping_problems, tensor_parallel_problems

logger = logging.getLogger("roll_gspo.config")

# A sequence ratio is a geometric mean of token ratios and stays within ~1e-3 of 1; a clip range
# wider than this essentially never fires under importance_sampling: seq.
SEQ_CLIP_WARN_ABOVE = 5e-3
# More optimizer steps than this per rollout: the later mini-batches train on responses of a
# policy many steps old, where a GSPO-sized clip zeroes most of their gradient.
MANY_OPTIMIZER_STEPS_PER_ROLLOUT = 16


def _fill_derived(cfg: PipelineConfig) -> None:
    """Turn the schema's null defaults into their documented values, in place."""
    if cfg.pipeline == "agentic":
        fill_agentic_defaults(cfg)  # before the generic ones: its lengths come from sequence_length
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
    cfg.loss_norm_length = _default_if_none(cfg.loss_norm_length, cfg.response_length)
    # ROLL: validation prompts are templated like the training prompts unless they name their own.
    if cfg.validation.data_args.template is None:
        cfg.validation.data_args.template = cfg.actor_train.data_args.template
    for reward in cfg.rewards.values():  # model-based rewards default to `reward_pretrain`
        reward.model_args.model_name_or_path = reward.model_args.model_name_or_path or cfg.reward_pretrain


def _default_if_none(value, default):
    return default if value is None else value


def _generating_problems(gen: GeneratingArgs, key: str) -> List[str]:
    problems = []
    if gen.temperature < 0:
        problems.append(f"{key}.temperature: must be >= 0 (0 is greedy), got {gen.temperature}")
    if not 0 < gen.top_p <= 1:
        problems.append(f"{key}.top_p: must be in (0, 1] (1 keeps the whole distribution), got {gen.top_p}")
    if gen.top_k < -1:
        problems.append(f"{key}.top_k: must be -1 or 0 (off) or a positive count, got {gen.top_k}")
    for name in ("max_new_tokens", "num_return_sequences"):
        if getattr(gen, name) < 1:
            problems.append(f"{key}.{name}: must be >= 1 (null means the default), got {getattr(gen, name)}")
    return problems


def _range_problems(cfg: PipelineConfig) -> List[str]:
    """Values outside the range where the key means anything (accepted silently before)."""
    problems = []
    for key in ("kl_loss_coef", "init_kl_coef"):
        if getattr(cfg, key) < 0:
            problems.append(f"{key}: must be >= 0 (a negative coefficient rewards moving away from the "
                            f"reference), got {getattr(cfg, key)}")
    if cfg.weight_sync_bucket_mb <= 0:
        problems.append(f"weight_sync_bucket_mb: must be > 0, got {cfg.weight_sync_bucket_mb}")
    if cfg.weight_sync_timeout_s <= 0:
        problems.append(f"weight_sync_timeout_s: must be > 0, got {cfg.weight_sync_timeout_s}")
    if cfg.loss_norm_length < 1:
        problems.append(f"loss_norm_length: must be >= 1 (null means response_length), got {cfg.loss_norm_length}")
    args = cfg.actor_train.training_args
    for name, low in (("learning_rate", 0), ("warmup_steps", 0), ("max_grad_norm", 0), ("weight_decay", 0)):
        if getattr(args, name) < low:
            problems.append(f"actor_train.training_args.{name}: must be >= {low}, got {getattr(args, name)}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            problems.append(f"actor_train.training_args.{name}: must be in [0, 1), got {getattr(args, name)}")
    if cfg.pipeline == "agentic":
        for key in ("train_env_manager", "val_env_manager"):
            problems += _generating_problems(getattr(cfg, key).generating_args, f"{key}.generating_args")
    if cfg.has_rollout():
        problems += _generating_problems(cfg.actor_infer.generating_args, "actor_infer.generating_args")
        problems += _generating_problems(cfg.validation.generating_args, "validation.generating_args")
    return problems


def _positive(cfg: PipelineConfig) -> List[str]:
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
            problems.append(f"{key}: must be >= 1, got {value}")
    for key in ("max_steps", "save_steps", "eval_steps", "save_total_limit"):
        if getattr(cfg, key) < 0:
            problems.append(f"{key}: must be >= 0, got {getattr(cfg, key)}")
    for name in ("actor_train", "actor_infer", "reference"):
        if getattr(cfg, name).num_cpus_per_worker <= 0:
            problems.append(f"{name}.num_cpus_per_worker: must be > 0 (fractions are fine), got "
                            f"{getattr(cfg, name).num_cpus_per_worker}")
    for domain, reward in cfg.rewards.items():
        if reward.num_cpus_per_worker <= 0:
            problems.append(f"rewards.{domain}.num_cpus_per_worker: must be > 0, got {reward.num_cpus_per_worker}")
        if reward.timeout_s <= 0:
            problems.append(f"rewards.{domain}.timeout_s: must be > 0, got {reward.timeout_s}")
    return problems


def _model_key(name: str) -> str:
    return name if name.startswith("builtin:") else os.path.realpath(os.path.expanduser(name))


def _model_and_engine_problems(cfg: PipelineConfig) -> List[str]:
    """The rollout engine must run the trained policy, in its dtype, with room for the lengths,
    sampling from generating_args only; DeepSpeed's precision must be model_args.dtype."""
    problems = []
    train_model = cfg.actor_train.model_args.model_name_or_path
    infer_model = cfg.actor_infer.model_args.model_name_or_path
    if _model_key(train_model) != _model_key(infer_model):
        problems.append(f"actor_infer.model_args.model_name_or_path = {infer_model!r} differs from "
                        f"actor_train.model_args.model_name_or_path = {train_model!r}: they must be the same "
                        f"policy (weight sync overwrites the rollout model after step 1, and step 1 samples "
                        f"from the other one). Leave both null to follow `pretrain`, or name the same folder")
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
                problems.append(f"{role_name}.strategy_args.strategy_config.{ds_key}.enabled = {enabled} contradicts "
                                f"{role_name}.model_args.dtype = {role.model_args.dtype}; roll_gspo fills DeepSpeed's "
                                f"bf16/fp16 sections from model_args.dtype: set the dtype there and drop {ds_key}")
    infer = cfg.actor_infer
    if infer.strategy_args.strategy_name != "vllm":
        return problems
    engine = infer.strategy_args.strategy_config
    key = "actor_infer.strategy_args.strategy_config"
    problems += tensor_parallel_problems(infer)
    if "dtype" in engine and vllm_dtype_name(engine["dtype"]) != infer.model_args.dtype:
        problems.append(f"{key}.dtype = {engine['dtype']!r} contradicts actor_infer.model_args.dtype = "
                        f"{infer.model_args.dtype!r}; the rollout dtype is set by model_args.dtype only (drop "
                        f"the engine's dtype or make it agree)")
    if "model" in engine and _model_key(str(engine["model"])) != _model_key(infer_model):
        problems.append(f"{key}.model = {engine['model']!r}: the rollout model is "
                        f"actor_infer.model_args.model_name_or_path ({infer_model!r}); drop the engine's model")
    needed = cfg.max_sequence_tokens()
    if isinstance(engine.get("max_model_len"), int) and engine["max_model_len"] < needed:
        problems.append(f"{key}.max_model_len = {engine['max_model_len']} is less than prompt_length + "
                        f"response_length = {cfg.prompt_length} + {cfg.response_length} = {needed}: vLLM would "
                        f"refuse long prompts or cut responses short; raise it to {needed} or drop it (the default)")
    if not (infer.num_gpus_per_worker or infer.device_mapping is not None):  # vLLM on CPU: prompts admitted whole
        length = engine["max_model_len"] if isinstance(engine.get("max_model_len"), int) else needed
        problems += prompt_split_problems(engine, length, key)
    if engine.get("generation_config", "vllm") != "vllm" or engine.get("override_generation_config"):
        problems.append(f"{key}.generation_config / override_generation_config: sampling comes from "
                        f"actor_infer.generating_args only (roll_gspo sets generation_config: vllm so nothing is "
                        f"taken from the model folder); set the sampling keys in generating_args and drop these")
    bias = rollout_logprobs_bias(cfg)
    if bias and cfg.old_logprob_source == "rollout":
        problems.append(f"old_logprob_source: rollout would bias every importance ratio: {bias}; or use "
                        f"old_logprob_source: trainer (or auto, the default, which takes the trainer's here)")
    return problems


def _rlvr_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    problems = []
    group = cfg.num_return_sequences_in_group
    batch = cfg.rollout_batch_size * group
    mini = cfg.mini_batch_size()
    args = cfg.actor_train.training_args
    rlvr = cfg.pipeline == "rlvr"  # the agentic pipeline checks its own batch, groups and data (agentic_checks)
    if rlvr and batch % mini:
        problems.append(
            f"batch arithmetic: rollout_batch_size * num_return_sequences_in_group = "
            f"{cfg.rollout_batch_size} * {group} = {batch} responses per step is not divisible by the "
            f"mini-batch actor_train.training_args.per_device_train_batch_size * "
            f"gradient_accumulation_steps * actor_train.world_size = {args.per_device_train_batch_size} "
            f"* {args.gradient_accumulation_steps} * {cfg.actor_train.world_size} = {mini}")
    if cfg.moe_aux_loss_coef < 0:
        problems.append(f"moe_aux_loss_coef must be >= 0 (0: off), got {cfg.moe_aux_loss_coef}")
    if cfg.old_logprob_auto_max_gap is not None and cfg.old_logprob_auto_max_gap < 0:
        problems.append(f"old_logprob_auto_max_gap must be >= 0 (0: never switch; null: pg_clip_low / 10), "
                        f"got {cfg.old_logprob_auto_max_gap}")
    if cfg.router_replay and cfg.old_logprob_source == "rollout":
        problems.append("router_replay: true replays the experts recorded while the trainer computes the old "
                        "log-probs; it needs old_logprob_source: trainer (or auto, the default)")
    problems += _async_problems(cfg)
    problems += rollout_correction_problems(cfg)
    if rlvr and cfg.adv_estimator in AGENTIC_ONLY_ESTIMATORS:
        problems.append(f"adv_estimator {cfg.adv_estimator!r} credits the turns of multi-turn episodes (pipeline: "
                        f"agentic); a single-turn response has one turn, where it is `reinforce`: use that")
    if rlvr and cfg.adv_estimator in ("grpo", "rloo") and group < 2:
        problems.append(f"adv_estimator {cfg.adv_estimator!r} needs num_return_sequences_in_group >= 2 "
                        f"(a group baseline of one response is the response itself), got {group}")
    if cfg.reward_shift and cfg.reward_scale:
        problems.append("reward_shift and reward_scale are both true: contradictory (shift only subtracts "
                        "the mean, scale only divides by the std; set both false for a full z-score)")
    if not 0 <= cfg.pg_clip_low < 1:
        problems.append(f"pg_clip_low: must be in [0, 1), got {cfg.pg_clip_low}")
    if cfg.pg_clip_high < 0:
        problems.append(f"pg_clip_high: must be >= 0, got {cfg.pg_clip_high}")
    if cfg.dual_clip_loss and cfg.dual_clip_c <= 1:
        problems.append(f"dual_clip_c: must be > 1 when dual_clip_loss is true, got {cfg.dual_clip_c}")
    for key in ("reward_clip", "advantage_clip"):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            problems.append(f"{key}: must be > 0 or null, got {value}")
    gen = cfg.actor_infer.generating_args
    if gen.num_return_sequences != group:
        problems.append(f"actor_infer.generating_args.num_return_sequences = {gen.num_return_sequences} "
                        f"contradicts num_return_sequences_in_group = {group}; leave it null")
    for key, generating in (("actor_infer", gen), ("validation", cfg.validation.generating_args)) if rlvr else ():
        if generating.max_new_tokens > cfg.response_length:
            problems.append(f"{key}.generating_args.max_new_tokens = {generating.max_new_tokens} exceeds "
                            f"response_length = {cfg.response_length}")
    if rlvr and cfg.reward_norm in ("group", "batch"):
        size = group if cfg.reward_norm == "group" else batch
        if size < 2:
            problems.append(f"reward_norm: {cfg.reward_norm} over sets of {size} response (num_return_sequences_in_group"
                            f" = {group}, rollout_batch_size = {cfg.rollout_batch_size}) turns every reward into 0; "
                            f"use reward_norm: null, or more responses per {cfg.reward_norm}")
    if cfg.actor_train.strategy_args.strategy_name not in TRAIN_STRATEGIES:
        problems.append(f"actor_train.strategy_args.strategy_name: must be 'deepspeed_train' or 'fsdp2_train', got "
                        f"{cfg.actor_train.strategy_args.strategy_name!r}")
    if cfg.actor_infer.strategy_args.strategy_name not in ("vllm", "hf_infer"):
        problems.append(f"actor_infer.strategy_args.strategy_name: must be 'vllm' or 'hf_infer', got "
                        f"{cfg.actor_infer.strategy_args.strategy_name!r}")
    if cfg.needs_reference() and cfg.reference.strategy_args.strategy_name not in (
            FROZEN_STRATEGIES + TRAIN_STRATEGIES + ["hf_infer"]):
        problems.append(f"reference.strategy_args.strategy_name: must be 'deepspeed_infer' or 'fsdp2_infer' (or "
                        f"their '_train' names, the same frozen engines) or 'hf_infer', got "
                        f"{cfg.reference.strategy_args.strategy_name!r}")
    if rlvr and not cfg.actor_train.data_args.file_name and not cfg.tasks:
        problems.append("actor_train.data_args.file_name: no training prompts given (nor `tasks`)")
    if rlvr and not cfg.rewards:
        problems.append("rewards: at least one reward domain is needed")
    for domain, reward in cfg.rewards.items():
        if reward.worker_cls.endswith("FunctionRewardWorker") and not reward.reward_fn:
            problems.append(f"rewards.{domain}.reward_fn: FunctionRewardWorker needs an import path "
                            f"`pkg.module:function`")
        problems += _reward_problems(domain, reward)
        if reward.strategy_args.strategy_name == "vllm" and not (reward.num_gpus_per_worker
                                                                  or reward.device_mapping is not None):
            engine = reward.strategy_args.strategy_config or {}
            length = engine["max_model_len"] if isinstance(engine.get("max_model_len"), int) else 2048  # the judge's
            problems += prompt_split_problems(engine, length, f"rewards.{domain}.strategy_args.strategy_config")
    problems += _model_and_engine_problems(cfg)
    problems += [p for p in unread_key_problems(cfg, yaml_keys)
                 if rlvr or not AGENTIC_TEMPLATE_KEYS.match(p)]  # agentic: checked by agentic_checks
    stage = cfg.actor_train.strategy_args.strategy_config.get("zero_optimization", {}).get("stage", 0)
    if cfg.actor_train.strategy_args.strategy_name == "deepspeed_train" and stage not in (0, 1, 2, 3):
        problems.append(f"actor_train.strategy_args.strategy_config.zero_optimization.stage: must be "
                        f"0, 1, 2 or 3, got {stage!r}")
    return problems


def _async_problems(cfg: PipelineConfig) -> List[str]:
    """async_generation_ratio: 0 or 1, and what one-step off-policy rollout cannot run with."""
    ratio = cfg.async_generation_ratio
    if ratio not in (0, 1):
        return [f"async_generation_ratio = {ratio!r} is refused: 0 (synchronous) and 1 (generation one "
                f"step ahead of training) are built; ROLL's larger integers are not"]
    if not ratio:
        return []
    problems = []
    if cfg.old_logprob_source == "trainer" or cfg.router_replay:
        problems.append(f"async_generation_ratio: 1 needs the rollout engine's old log-probs (old_logprob_source: "
                        f"rollout or auto, got {cfg.old_logprob_source}"
                        f"{' with router_replay, which needs the trainer' if cfg.router_replay else ''}): the "
                        "responses are sampled by the weights of the step before, which only the rollout engine "
                        "still holds; the trainer's recompute would score the newer policy and the ratio would not "
                        "correct for the staleness")
    elif cfg.old_logprob_source == "auto":  # an explicit rollout with a bias is refused on its own
        bias = rollout_logprobs_bias(cfg)
        if bias:
            problems.append(f"async_generation_ratio: 1 needs the rollout engine's old log-probs, and they would "
                            f"bias every ratio here: {bias}")
    from roll_gspo.placement.colocation import offload_between_phases

    if offload_between_phases(cfg):
        problems.append("async_generation_ratio: 1 with the rollout engine put to sleep between phases "
                        "(is_offload_states, or roles sharing GPUs) is refused: generating ahead needs the "
                        "rollout engine awake while the trainer trains, on devices of its own")
    filtered = [name for name, reward in cfg.rewards.items() if reward.query_filter_config.type != "no_filter"]
    if filtered:
        problems.append(f"async_generation_ratio: 1 with dynamic sampling (rewards.{filtered[0]}."
                        f"query_filter_config) is not built: the extra generation rounds would need the "
                        f"scores of the rollout generated ahead")
    return problems


def _dynamic_batching_problems(cfg: PipelineConfig) -> List[str]:
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
                problems.append(f"{name}.use_dynamic_batching_in_{phase}: nothing reads it: {why}")
            if not on:
                continue
            if not budget or budget < longest:
                problems.append(f"{name}.max_tokens_per_microbatch_in_{phase} = {budget}: with "
                                f"use_dynamic_batching_in_{phase} it must be set to at least one whole sequence, "
                                f"{'sequence_length' if cfg.pipeline == 'agentic' else 'prompt_length + response_length'}"
                                f" = {longest} tokens")
            if rounding < 1:
                problems.append(f"{name}.sequence_length_round_in_{phase}: must be >= 1, got {rounding}")
    return problems


def _reward_problems(domain: str, reward) -> List[str]:
    """Keys of the model-free and model-based reward workers that cannot act as given."""
    import re

    problems, kind = [], reward.worker_cls.rpartition(".")[2]
    key = f"rewards.{domain}"
    if reward.response_length_penalty_coef < 0:
        problems.append(f"{key}.response_length_penalty_coef: must be >= 0, got {reward.response_length_penalty_coef}")
    if reward.format_pattern:
        try:
            re.compile(reward.format_pattern)
        except re.error as exc:
            problems.append(f"{key}.format_pattern: not a valid regex ({exc})")
    if kind == "CodeSandboxRewardWorker":
        if not reward.use_local or reward.code_url:
            problems.append(f"{key}: a remote code sandbox (use_local: false / code_url) is not built; set "
                            f"use_local: true and drop code_url (tests then run in a local sandbox)")
        if reward.sandbox_memory_mb < 16 or reward.sandbox_max_processes < 1:
            problems.append(f"{key}: sandbox_memory_mb must be >= 16 and sandbox_max_processes >= 1")
    if kind == "LLMJudgeRewardWorker":
        if (reward.judge_model_type or "api") == "api" and not reward.judge_api_url:
            problems.append(f"{key}.judge_api_url: judge_model_type api needs the endpoint's base URL "
                            f"(e.g. http://127.0.0.1:8000/v1), or set judge_model_type: inference")
        if reward.judge_model_type == "inference" and reward.strategy_args.strategy_name not in ("vllm", "hf_infer"):
            problems.append(f"{key}.strategy_args.strategy_name: a judge loaded by the worker runs on vllm or "
                            f"hf_infer, got {reward.strategy_args.strategy_name!r}")
        if reward.judge_max_retries < 0:
            problems.append(f"{key}.judge_max_retries: must be >= 0, got {reward.judge_max_retries}")
    if kind in ("RewardModelWorker", "LLMJudgeRewardWorker") and reward.infer_batch_size < 1:
        problems.append(f"{key}.infer_batch_size: must be >= 1, got {reward.infer_batch_size}")
    return problems


def _sft_problems(cfg: PipelineConfig) -> List[str]:
    problems = []
    if not cfg.actor_train.data_args.file_name:
        problems.append("actor_train.data_args.file_name: no SFT data given")
    return problems


def _warn_traps(cfg: PipelineConfig) -> List[str]:
    warns = []
    batch = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    mini = cfg.mini_batch_size()
    clip = max(cfg.pg_clip_low, cfg.pg_clip_high)
    if cfg.ppo_epochs * (batch // max(mini, 1)) == 1:
        warns.append(
            f"one optimizer step per rollout (ppo_epochs = 1 and the whole batch of {batch} is one "
            f"mini-batch): the importance ratio is exactly 1 at that step, clipping never fires and "
            f"GSPO degenerates to plain policy gradient. Lower gradient_accumulation_steps or "
            f"per_device_train_batch_size to get several mini-batches (the GSPO paper uses 4).")
    if cfg.importance_sampling in ("seq", "gspo-token") and clip > SEQ_CLIP_WARN_ABOVE:
        warns.append(
            f"importance_sampling: {cfg.importance_sampling} with a token-sized clip range "
            f"(pg_clip_low={cfg.pg_clip_low}, pg_clip_high={cfg.pg_clip_high}): sequence ratios stay "
            f"within ~1e-3 of 1, so this almost never clips. The GSPO paper uses 3e-4 / 4e-4.")
    if cfg.importance_sampling == "token" and clip < 1e-2:
        warns.append(f"importance_sampling: token with a sequence-sized clip range ({clip}): most "
                     f"tokens will be clipped; PPO/GRPO use about 0.2.")
    if cfg.reward_norm is None and (cfg.reward_shift or cfg.reward_scale):
        warns.append("reward_shift / reward_scale have no effect while reward_norm is null")
    if cfg.use_kl_loss and cfg.add_token_level_kl:
        warns.append("use_kl_loss and add_token_level_kl are both on: KL is penalised twice")
    if cfg.old_logprob_source == "rollout" and cfg.importance_sampling == "token":
        warns.append("old_logprob_source: rollout with token-level ratios: the engines' per-token "
                     "precision mismatch enters every ratio; GSPO's sequence ratio averages it out")
    steps = cfg.ppo_epochs * (batch // max(mini, 1))
    if steps > MANY_OPTIMIZER_STEPS_PER_ROLLOUT:
        args = cfg.actor_train.training_args
        wanted = batch // 4
        warns.append(
            f"{steps} optimizer steps per rollout: ppo_epochs * rollout_batch_size * num_return_sequences_in_group "
            f"/ (actor_train.training_args.per_device_train_batch_size * gradient_accumulation_steps * "
            f"actor_train.world_size) = {cfg.ppo_epochs} * {cfg.rollout_batch_size} * {cfg.num_return_sequences_in_group}"
            f" / ({args.per_device_train_batch_size} * {args.gradient_accumulation_steps} * "
            f"{cfg.actor_train.world_size}) = {steps}. By the later mini-batches the policy has taken up to "
            f"{steps - 1} steps since it sampled their responses, so their ratios leave the clip range "
            f"(pg_clip_low / pg_clip_high = {cfg.pg_clip_low} / {cfg.pg_clip_high}) and give no gradient: most "
            f"of the rollout is wasted. The GSPO paper takes 4 steps per rollout, i.e. a mini-batch of {wanted} "
            f"responses (raise gradient_accumulation_steps or per_device_train_batch_size).")
    rollout_threads = {**cfg.system_envs, **cfg.actor_infer.system_envs}.get("OMP_NUM_THREADS", "")
    reserved = max(1, int(cfg.actor_infer.num_cpus_per_worker))
    if (cfg.async_generation_ratio and rollout_threads.isdigit() and int(rollout_threads) > reserved
            and not cfg.actor_infer.num_gpus_per_worker):
        warns.append(
            f"async_generation_ratio: 1 with OMP_NUM_THREADS = {rollout_threads} in actor_infer's system_envs, "
            f"more threads than the {cfg.actor_infer.num_cpus_per_worker:g} CPU it reserves: generation now runs "
            f"while the trainer trains, so those threads take the trainer's cores. Drop the setting (the "
            f"synchronous examples set it because the trainer waits while vLLM generates).")
    if cfg.model_update_frequency > 1 and not correction_enabled(cfg):  # its weights pi_old / pi_rollout correct it
        k = cfg.model_update_frequency
        source = choose_old_logprob_source(cfg).source  # auto takes the trainer's here
        measured = ("the current trainer weights at the start of each step, not the older weights that sampled: "
                    "the staleness is neither corrected nor clipped" if source == "trainer" else
                    "the stale rollout weights, so it starts far from 1 and a GSPO-sized clip zeroes most gradients")
        warns.append(
            f"model_update_frequency = {k}: the rollout engine gets new weights every {k} steps, so up to {k - 1} "
            f"of every {k} rollouts are sampled by weights up to {k - 1} updates old (off-policy), and nothing "
            f"corrects for it. With old_logprob_source: {source} the importance ratio measures the "
            f"policy's change from {measured}. Use 1 unless you accept that, or turn on train_infer_correction "
            f"(its weights pi_old / pi_rollout then correct for the stale sampler).")
    engine = cfg.actor_infer.strategy_args.strategy_config
    if (cfg.actor_infer.strategy_args.strategy_name == "vllm" and "logprobs_mode" in engine
            and cfg.old_logprob_source != "rollout"):
        warns.append(f"actor_infer.strategy_args.strategy_config.logprobs_mode = {engine['logprobs_mode']!r} only "
                     f"changes the logged rollout/logprob_gap (old log-probs come from the trainer); without it "
                     f"roll_gspo picks the mode that matches the trainer's log-probs")
    if cfg.actor_infer.model_args.dtype != "fp32" and cfg.old_logprob_source == "rollout":
        warns.append(f"old_logprob_source: rollout with actor_infer dtype {cfg.actor_infer.model_args.dtype}: "
                     f"rollout log-probs may be far from the trainer's")
    return warns


QUERY_FILTER_ARGS = {"no_filter": set(), "mean_filter": {"threshold_up", "threshold_down"},
                     "std_filter": {"std_threshold"}}


def _sampling_problems(cfg: PipelineConfig) -> List[str]:
    problems = []
    for domain, reward in cfg.rewards.items():
        qf = reward.query_filter_config
        key = f"rewards.{domain}.query_filter_config"
        unknown = sorted(set(qf.filter_args) - QUERY_FILTER_ARGS.get(qf.type, set()))
        if unknown:
            valid = sorted(QUERY_FILTER_ARGS.get(qf.type, set()))
            problems.append(f"{key}.filter_args: {unknown} do nothing with type {qf.type!r} "
                            f"(valid: {valid or 'none'})")
        for arg, value in qf.filter_args.items():
            if arg not in unknown and (isinstance(value, bool) or not isinstance(value, (int, float))):
                problems.append(f"{key}.filter_args.{arg}: expected a number, got {value!r}")
    if cfg.query_filter_max_rounds < 1:
        problems.append(f"query_filter_max_rounds: must be >= 1, got {cfg.query_filter_max_rounds}")
    if cfg.validation.data_args.domain_interleave_probs:
        problems.append("validation.data_args.domain_interleave_probs: only the training prompts are mixed "
                        "by domain (actor_train.data_args.domain_interleave_probs); validation uses every row")
    probs = cfg.actor_train.data_args.domain_interleave_probs
    if probs:
        key = "actor_train.data_args.domain_interleave_probs"
        unknown = sorted(set(probs) - set(cfg.rewards))
        if unknown:
            problems.append(f"{key}: {unknown} are not reward domains (keys under `rewards`: "
                            f"{sorted(cfg.rewards)})")
        bad = {d: p for d, p in probs.items() if not p >= 0}
        if bad or sum(probs.values()) <= 0:
            problems.append(f"{key}: shares must be >= 0 with a positive sum, got {dict(probs)}")
    return problems


def _no_validation_notice(cfg: PipelineConfig) -> List[str]:
    """eval_steps without validation prompts: ROLL skips validation then (its judge recipe sets
    eval_steps and no validation block); so does this run, saying so once."""
    if not cfg.eval_steps or cfg.validation.data_args.file_name or cfg.tasks:  # tasks bring their own
        return []
    steps, cfg.eval_steps = cfg.eval_steps, 0
    return [f"notice: eval_steps = {steps} is ignored: validation.data_args.file_name is empty, so there is "
            f"nothing to validate on (ROLL skips it too); give validation prompts to validate every {steps} steps"]


def validate_config(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    """Fill derived defaults, raise ConfigError on any problem, log and return the warnings.

    `yaml_keys`: dotted paths the YAML writes (the loader passes them); a key never read by its
    role is refused only when written there. None: every key that differs from its default counts.
    """
    pipeline_notices = infer_agentic_pipeline(cfg, yaml_keys)  # ROLL picks the pipeline by its start script
    placement_problems = device_mapping_problems(cfg)  # derives world_size before the batch arithmetic
    placement_problems += roll_compat.pipeline_grad_norm_problems(cfg, yaml_keys)
    _fill_derived(cfg)
    critic_notices = fill_critic_defaults(cfg, yaml_keys) + fill_agentic_ratio(cfg, yaml_keys)
    problems = placement_problems + _positive(cfg) + _range_problems(cfg)
    if cfg.has_rollout():
        problems += _sampling_problems(cfg)
    problems += _rlvr_problems(cfg, yaml_keys) if cfg.has_rollout() else _sft_problems(cfg)
    if cfg.pipeline == "agentic":
        problems += agentic_problems(cfg, yaml_keys)
    problems += agentic_keys_in_other_pipelines(cfg, yaml_keys)
    problems += _dynamic_batching_problems(cfg)
    problems += roll_compat.roll_semantic_problems(cfg)
    problems += fsdp2_problems(cfg)
    problems += lora_problems(cfg)
    problems += critic_problems(cfg)
    problems += task_problems(cfg)
    if not placement_problems:  # colocation and weight routes read the parsed device mappings
        from roll_gspo.placement.cluster_plan import weight_route_problems
        from roll_gspo.placement.colocation import colocation_problems, fill_gpu_memory_utilization

        problems += colocation_problems(cfg)
        problems += weight_route_problems(cfg)
    if problems:
        raise ConfigError(problems)
    if cfg.has_rollout():
        fill_gpu_memory_utilization(cfg)  # a shared GPU: vLLM reserves its share, not vLLM's 0.9
    warns = _warn_traps(cfg) + ignored_key_notices(cfg, yaml_keys) + _no_validation_notice(cfg) \
        if cfg.pipeline == "rlvr" else _warn_traps(cfg) + agentic_notices(cfg, yaml_keys) \
        if cfg.pipeline == "agentic" else []
    warns += roll_compat.roll_warnings(cfg) + fsdp2_notices(cfg) + pipeline_notices + lora_warnings(cfg) + critic_notices
    for message in warns:
        logger.warning(message)
    return warns
