"""Checks of the reward blocks (`rewards.<domain>.*`) and of dynamic sampling and the domain mix,
before any reward worker starts (what their import paths name is preflight's)."""
from __future__ import annotations

import re
from typing import AbstractSet, List, Optional

from roll_gspo.catalog.reward_workers import loads_model
from roll_gspo.config.findings import Finding, error
from roll_gspo.config.registry import check
from roll_gspo.config.schema import PipelineConfig, RewardConfig
from roll_gspo.config.vllm_prefill import prompt_split_problems

QUERY_FILTER_ARGS = {"no_filter": set(), "mean_filter": {"threshold_up", "threshold_down"},
                     "std_filter": {"std_threshold"}}


@check("check", keys=("rewards", "rewards.<domain>.reward_fn", "rewards.<domain>.format_pattern",
                      "rewards.<domain>.use_local", "rewards.<domain>.judge_api_url",
                      "rewards.<domain>.strategy_args.strategy_config"),
       doc="reward workers that cannot act as given: no reward domain (rlvr), a FunctionRewardWorker without "
           "`reward_fn`, a bad `format_pattern` regex, a remote code sandbox, an API judge without its URL, a "
           "judge's vLLM on CPU splitting prompts", name="rewards.workers", rollout_only=True)
def _reward_workers(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    problems: List[Finding] = []
    if cfg.pipeline == "rlvr" and not cfg.rewards:
        problems.append(error("rewards", "rewards: at least one reward domain is needed"))
    for domain, reward in cfg.rewards.items():
        if reward.worker_cls.endswith("FunctionRewardWorker") and not reward.reward_fn:
            problems.append(error(f"rewards.{domain}.reward_fn", f"rewards.{domain}.reward_fn: FunctionRewardWorker "
                                                                 f"needs an import path `pkg.module:function`"))
        problems += _reward_problems(domain, reward)
        if reward.strategy_args.strategy_name == "vllm" and not (reward.num_gpus_per_worker
                                                                  or reward.device_mapping is not None):
            engine = reward.strategy_args.strategy_config or {}
            length = engine["max_model_len"] if isinstance(engine.get("max_model_len"), int) else 2048  # the judge's
            key = f"rewards.{domain}.strategy_args.strategy_config"
            problems += [error(key, p) for p in prompt_split_problems(engine, length, key)]
    return problems


def _reward_problems(domain: str, reward: RewardConfig) -> List[Finding]:
    """Keys of the model-free and model-based reward workers that cannot act as given."""
    problems, kind = [], reward.worker_cls.rpartition(".")[2]
    key = f"rewards.{domain}"
    if reward.response_length_penalty_coef < 0:
        problems.append(error(f"{key}.response_length_penalty_coef", f"{key}.response_length_penalty_coef: must be >= "
                                                                     f"0, got {reward.response_length_penalty_coef}"))
    if reward.format_pattern:
        try:
            re.compile(reward.format_pattern)
        except re.error as exc:
            problems.append(error(f"{key}.format_pattern", f"{key}.format_pattern: not a valid regex ({exc})"))
    if kind == "CodeSandboxRewardWorker":
        if not reward.use_local or reward.code_url:
            problems.append(error(f"{key}.use_local", f"{key}: a remote code sandbox (use_local: false / code_url) is "
                                                      f"not built; set use_local: true and drop code_url (tests then "
                                                      f"run in a local sandbox)"))
        if reward.sandbox_memory_mb < 16 or reward.sandbox_max_processes < 1:
            problems.append(error(f"{key}.sandbox_memory_mb", f"{key}: sandbox_memory_mb must be >= 16 and "
                                                              f"sandbox_max_processes >= 1"))
    if kind == "LLMJudgeRewardWorker":
        if (reward.judge_model_type or "api") == "api" and not reward.judge_api_url:
            problems.append(error(f"{key}.judge_api_url", f"{key}.judge_api_url: judge_model_type api needs the "
                                                          f"endpoint's base URL (e.g. http://127.0.0.1:8000/v1), or "
                                                          f"set judge_model_type: inference"))
        if reward.judge_model_type == "inference" and reward.strategy_args.strategy_name not in ("vllm", "hf_infer"):
            problems.append(error(f"{key}.strategy_args.strategy_name",
                                  f"{key}.strategy_args.strategy_name: a judge loaded by the worker runs on vllm or "
                                  f"hf_infer, got {reward.strategy_args.strategy_name!r}"))
        if reward.judge_max_retries < 0:
            problems.append(error(f"{key}.judge_max_retries", f"{key}.judge_max_retries: must be >= 0, got "
                                                              f"{reward.judge_max_retries}"))
    if loads_model(reward.worker_cls) and reward.infer_batch_size < 1:
        problems.append(error(f"{key}.infer_batch_size", f"{key}.infer_batch_size: must be >= 1, got "
                                                         f"{reward.infer_batch_size}"))
    return problems


@check("check", keys=("rewards.<domain>.query_filter_config", "query_filter_max_rounds",
                      "actor_train.data_args.domain_interleave_probs", "validation.data_args.domain_interleave_probs"),
       doc="dynamic sampling: `filter_args` its filter type does not read or that are not numbers, "
           "`query_filter_max_rounds` < 1; a domain mix naming no reward domain or without a positive share",
       name="rewards.sampling", rollout_only=True)
def _sampling_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    problems = []
    for domain, reward in cfg.rewards.items():
        qf = reward.query_filter_config
        key = f"rewards.{domain}.query_filter_config"
        unknown = sorted(set(qf.filter_args) - QUERY_FILTER_ARGS.get(qf.type, set()))
        if unknown:
            valid = sorted(QUERY_FILTER_ARGS.get(qf.type, set()))
            problems.append(error(f"{key}.filter_args", f"{key}.filter_args: {unknown} do nothing with type "
                                                        f"{qf.type!r} (valid: {valid or 'none'})"))
        for arg, value in qf.filter_args.items():
            if arg not in unknown and (isinstance(value, bool) or not isinstance(value, (int, float))):
                problems.append(error(f"{key}.filter_args.{arg}", f"{key}.filter_args.{arg}: expected a number, got "
                                                                  f"{value!r}"))
    if cfg.query_filter_max_rounds < 1:
        problems.append(error("query_filter_max_rounds", f"query_filter_max_rounds: must be >= 1, got "
                                                         f"{cfg.query_filter_max_rounds}"))
    if cfg.validation.data_args.domain_interleave_probs:
        problems.append(error("validation.data_args.domain_interleave_probs",
                              "validation.data_args.domain_interleave_probs: only the training prompts are mixed by "
                              "domain (actor_train.data_args.domain_interleave_probs); validation uses every row"))
    probs = cfg.actor_train.data_args.domain_interleave_probs
    if probs:
        key = "actor_train.data_args.domain_interleave_probs"
        unknown = sorted(set(probs) - set(cfg.rewards))
        if unknown:
            problems.append(error(key, f"{key}: {unknown} are not reward domains (keys under `rewards`: "
                                       f"{sorted(cfg.rewards)})"))
        bad = {d: p for d, p in probs.items() if not p >= 0}
        if bad or sum(probs.values()) <= 0:
            problems.append(error(key, f"{key}: shares must be >= 0 with a positive sum, got {dict(probs)}"))
    return problems
