"""One policy, one precision, enough room: the rollout engine runs the trained policy in its dtype, with
room for the lengths and sampling from generating_args only; DeepSpeed's precision is model_args.dtype."""
from __future__ import annotations

import os
from typing import AbstractSet, List, Optional

from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error
from roll_gspo.config.plan.engine_logprobs import rollout_logprobs_bias, vllm_dtype_name
from roll_gspo.config.plan.vllm_prefill import prompt_split_problems
from roll_gspo.schema.config import PipelineConfig


# vLLM's `generation_config` value that takes no sampling defaults from the model folder (what
# roll_gspo sets): sampling comes from generating_args alone.
VLLM_OWN_DEFAULTS = "vllm"


def _model_key(name: Optional[str]) -> str:
    name = name or ""  # filled by the derive phase (null follows `pretrain`)
    return name if name.startswith("builtin:") else os.path.realpath(os.path.expanduser(name))


@check("check", keys=("<role>.model_args.model_name_or_path", "<role>.model_args.dtype",
                      "actor_infer.strategy_args.strategy_config", "old_logprob_source"),
       doc="one policy, one precision, enough room: actor_infer's model differing from actor_train's (or a vLLM "
           "`model`), a vLLM `dtype` or DeepSpeed `bf16`/`fp16.enabled` contradicting `model_args.dtype`, a vLLM "
           "`max_model_len` below prompt_length + response_length, a `tensor_parallel_size` above the rank's "
           "reservation, prompts split on CPU, sampling from the model folder's generation_config, "
           "`old_logprob_source: rollout` where vLLM's log-probs are not the trainer's", name="model_engine.problems")
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
