"""ROLL's keys as config steps: values that cannot act here, Megatron keys of a DeepSpeed role, ROLL's
top-level `max_grad_norm`, `value_clip` without a critic. The translation itself (names, aliases,
refused values) is `roll_gspo.config.roll.roll_compat`'s, run by the loader; the step names keep
their `roll_compat.` prefix, the concern they belong to."""
from __future__ import annotations

from typing import List

from roll_gspo.catalog.engines import names
from roll_gspo.catalog.reward_workers import loads_model
from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error, warning
from roll_gspo.config.roll.roll_compat import foreign_strategy_key_problems


@check("check", keys=("<role>.model_args.model_type", "<role>.model_args.attn_implementation",
                      "<role>.strategy_args.strategy_name", "actor_infer.strategy_args.strategy_config.block_size",
                      "difficulty_low_threshold", "entropy_loss_coef", "num_gpus_per_node",
                      "actor_train.data_args.preprocessing_num_workers"),
       doc="ROLL values that cannot act here: a `model_type` on a policy role, flash_attention_2 on CPU, a "
           "frozen engine training or deepspeed_infer sampling, a CPU vLLM `block_size` not a multiple of 32, "
           "difficulty thresholds out of order", name="roll_compat.semantics")
def _roll_semantics(cfg, yaml_keys) -> List[Finding]:
    problems = []
    for name in ("actor_train", "actor_infer", "reference"):
        role = getattr(cfg, name)
        if role.model_args.model_type is not None:
            problems.append(error(f"{name}.model_args.model_type", f"{name}.model_args.model_type = "
                                                                   f"{role.model_args.model_type!r}: a policy role is "
                                                                   f"a causal LM; model_type is for reward models "
                                                                   f"(leave it null)"))
        if role.model_args.attn_implementation == "flash_attention_2" and not role.num_gpus_per_worker:
            problems.append(error(f"{name}.model_args.attn_implementation",
                                  f"{name}.model_args.attn_implementation: flash_attention_2 (ROLL's fa2) needs a CUDA "
                                  f"GPU and runs on CPU nowhere; use sdpa on CPU"))
    for domain, reward in cfg.rewards.items():  # a judge or reward model loaded by transformers (hf_infer) on CPUs
        if (reward.model_args.attn_implementation == "flash_attention_2" and not reward.num_gpus_per_worker
                and reward.strategy_args.engine.reads_attn_implementation
                and loads_model(reward.worker_cls)):
            key = f"rewards.{domain}.model_args.attn_implementation"
            problems.append(error(key, f"{key}: flash_attention_2 (ROLL's fa2) needs a CUDA GPU and runs on CPU "
                                       f"nowhere; use sdpa on CPU"))
    if cfg.actor_infer.strategy_args.engine.kind == "frozen":
        problems.append(error("actor_infer.strategy_args.strategy_name",
                              f"actor_infer.strategy_args.strategy_name: {cfg.actor_infer.strategy_args.strategy_name} "
                              f"scores but does not sample; use {' or '.join(names('actor_infer'))}"))
    infer = cfg.actor_infer
    block = (infer.strategy_args.strategy_config or {}).get("block_size")
    if infer.strategy_args.engine.vllm_engine_args and not infer.num_gpus_per_worker and block and block % 32:
        key = "actor_infer.strategy_args.strategy_config.block_size"
        problems.append(error(key, f"{key} = {block}: vLLM's CPU attention needs a multiple of 32 (ROLL's 16 is a "
                                   f"GPU value); use 32 on CPU"))
    frozen = cfg.actor_train.strategy_args.strategy_name
    if cfg.actor_train.strategy_args.engine.kind == "frozen":
        problems.append(error("actor_train.strategy_args.strategy_name",
                              f"actor_train.strategy_args.strategy_name: {frozen} is a frozen engine; use "
                              f"{frozen.replace('_infer', '_train')}"))
    if not 0.0 <= cfg.difficulty_low_threshold <= cfg.difficulty_high_threshold <= 1.0 and cfg.difficulty_mask:
        problems.append(error("difficulty_low_threshold", f"difficulty_low_threshold / difficulty_high_threshold = "
                                                          f"{cfg.difficulty_low_threshold} / "
                                                          f"{cfg.difficulty_high_threshold}: need 0 <= low <= high <= "
                                                          f"1"))
    if cfg.entropy_loss_coef < 0:
        problems.append(error("entropy_loss_coef", f"entropy_loss_coef: must be >= 0, got {cfg.entropy_loss_coef}"))
    if cfg.num_gpus_per_node < 1:
        problems.append(error("num_gpus_per_node", f"num_gpus_per_node: must be >= 1, got {cfg.num_gpus_per_node}"))
    if cfg.actor_train.data_args.preprocessing_num_workers is not None and \
            cfg.actor_train.data_args.preprocessing_num_workers < 1:
        problems.append(error("actor_train.data_args.preprocessing_num_workers",
                              "actor_train.data_args.preprocessing_num_workers: must be >= 1 or null"))
    return problems


@check("normalise", keys=("<role>.strategy_args.strategy_config",),
       doc="Megatron keys of a deepspeed_* role turned into their DeepSpeed form (data-parallel sizes of 1 "
           "dropped, `use_distributed_optimizer` as ZeRO stage 1, `recompute_granularity: full` as gradient "
           "checkpointing); refuses model parallelism, selective recompute and other Megatron/FSDP options",
       name="roll_compat.megatron_keys")
def _megatron_keys(cfg, yaml_keys) -> List[Finding]:
    problems: List[Finding] = []
    for name in ("actor_train", "reference") + (("critic",) if cfg.critic is not None else ()):
        problems += foreign_strategy_key_problems(name, getattr(cfg, name))
    return problems


@check("warn", keys=("value_clip",), doc="`value_clip` without a critic (it clips a critic's value loss)",
       name="roll_compat.value_clip")
def _roll_warnings(cfg, yaml_keys) -> List[Finding]:
    if cfg.value_clip is not None and not cfg.uses_critic():
        return [warning("value_clip", f"value_clip = {cfg.value_clip} has no effect: it clips a critic's value loss "
                                      f"and this run has no critic (adv_estimator {cfg.adv_estimator}); ROLL ignores "
                                      f"it too without gae. Remove it to silence this warning.")]
    return []


@check("normalise", keys=("max_grad_norm", "actor_train.training_args.max_grad_norm"),
       doc="ROLL's top-level `max_grad_norm` acts as actor_train.training_args.max_grad_norm; refused when "
           "both are written and differ", name="roll_compat.grad_norm")
def _pipeline_grad_norm(cfg, yaml_keys) -> List[Finding]:
    """ROLL's top-level `max_grad_norm` (what its FSDP2/Megatron strategies clip with) acts as
    actor_train.training_args.max_grad_norm; both written and different is a contradiction."""
    if cfg.max_grad_norm is None:
        return []
    args = cfg.actor_train.training_args
    key = "actor_train.training_args.max_grad_norm"
    if yaml_keys is not None and key in yaml_keys and args.max_grad_norm != cfg.max_grad_norm:
        return [error("max_grad_norm", f"max_grad_norm = {cfg.max_grad_norm} contradicts {key} = {args.max_grad_norm}: "
                                       f"ROLL reads the top-level one in its FSDP2/Megatron strategies and "
                                       f"training_args' in DeepSpeed; write one")]
    args.max_grad_norm = cfg.max_grad_norm
    return []
