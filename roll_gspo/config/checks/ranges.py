"""Values outside the range where their key means anything: coefficients, learning-rate keys, sampling
keys, counts and sizes below 1, CPU reservations and timeouts."""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error
from roll_gspo.schema.config import GeneratingArgs, PipelineConfig, RoleConfig


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
           "`loss_norm_length` (only null means the default)", name="ranges.values")
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
           "reservations and reward timeouts <= 0", name="ranges.counts")
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
