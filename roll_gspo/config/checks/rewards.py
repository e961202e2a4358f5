"""Checks of the reward blocks (`rewards.<domain>.*`) and of dynamic sampling and the domain mix,
before any reward worker starts (what their import paths name is preflight's)."""
from __future__ import annotations

import math
import re
from typing import AbstractSet, Dict, List, Optional, Tuple

from roll_gspo.catalog import engines
from roll_gspo.catalog.estimators import ESTIMATORS
from roll_gspo.catalog.reward_workers import kind_of, loads_model
from roll_gspo.config.findings import Finding, error, warning
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig, RewardConfig
from roll_gspo.config.plan.vllm_prefill import prompt_split_problems

# The numbers each built-in reward worker reports per response (its `reward_metrics`), which is all
# `gdpo_reward_keys` can name there; a built-in worker not listed sends none (one combined score).
REWARD_COMPONENTS: Dict[str, Tuple[str, ...]] = {
    "TaskRewardWorker": ("accuracy", "format_rate", "answer_score", "truncated"),
    "IFEvalRewardWorker": ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc",
                           "inst_level_loose_acc"),
}
# Built-in workers whose reward function is the user's, which may return a `ScoreWithMetrics`.
USER_SCORED = ("FunctionRewardWorker",)
# Keys that reshape the combined score, which GDPO does not read (its components stand for it).
SCORE_SHAPING = ("reward_norm", "reward_clip", "add_token_level_kl")

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
        if reward.strategy_args.engine.vllm_engine_args and not (reward.num_gpus_per_worker
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
        if reward.judge_model_type == "inference" and "judge" not in reward.strategy_args.engine.roles:
            problems.append(error(f"{key}.strategy_args.strategy_name",
                                  f"{key}.strategy_args.strategy_name: a judge loaded by the worker runs on "
                                  f"{' or '.join(engines.names('judge'))}, got "
                                  f"{reward.strategy_args.strategy_name!r}"))
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


@check("check", keys=("adv_estimator", "gdpo_reward_keys", "gdpo_reward_weights", "rewards.<domain>.worker_cls",
                      "rewards.<domain>.response_length_penalty_coef", "tasks.<key>.format_weight", "reward_norm",
                      "reward_clip", "add_token_level_kl"),
       doc="`adv_estimator: gdpo`: a reward block whose worker does not send every `gdpo_reward_keys` component "
           "(a single-reward worker sends none), weights not one per key, a task with format_weight 0 while "
           "format_rate is a component, and keys reshaping the combined score GDPO does not read (reward_norm, "
           "reward_clip, add_token_level_kl, response_length_penalty_coef)",
       name="rewards.gdpo_components", rollout_only=True)
def _gdpo_components(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    estimator = ESTIMATORS.get(cfg.adv_estimator)
    if cfg.pipeline != "rlvr" or estimator is None or not estimator.components:
        return []
    name, keys, weights = cfg.adv_estimator, list(cfg.gdpo_reward_keys), cfg.gdpo_reward_weights
    problems: List[Finding] = []
    if not keys or len(set(keys)) != len(keys):
        problems.append(error("gdpo_reward_keys", f"gdpo_reward_keys = {keys}: adv_estimator {name} needs the names "
                                                  f"of the reward components to normalise apart, each once"))
    if weights is not None and (len(weights) != len(keys) or not all(math.isfinite(w) for w in weights)):
        problems.append(error("gdpo_reward_weights", f"gdpo_reward_weights = {list(weights)}: one finite weight per "
                                                     f"gdpo_reward_keys entry {keys} (or null: all 1)"))
    for domain, reward in cfg.rewards.items():
        worker = reward.worker_cls.rpartition(".")[2]
        block = f"rewards.{domain}"
        if kind_of(reward.worker_cls) is None or worker in USER_SCORED:
            continue  # what it reports is known when it runs (a response missing a key fails the step, naming it)
        sent = REWARD_COMPONENTS.get(worker, ())
        missing = [k for k in keys if k not in sent]
        if missing and not sent:
            problems.append(error(f"{block}.worker_cls", (
                f"adv_estimator {name} normalises each reward component apart, but {block}.worker_cls {worker} "
                f"sends one combined score and no components (gdpo_reward_keys = {keys}); use adv_estimator grpo, or "
                f"a worker reporting its parts per response (TaskRewardWorker through `tasks`, or a "
                f"FunctionRewardWorker whose reward_fn returns a ScoreWithMetrics)")))
        elif missing:
            problems.append(error("gdpo_reward_keys", (
                f"gdpo_reward_keys = {keys}: {block}.worker_cls {worker} does not send {missing} (it sends "
                f"{list(sent)}); name components every reward block reports")))
        if reward.response_length_penalty_coef:
            problems.append(error(f"{block}.response_length_penalty_coef", (
                f"{block}.response_length_penalty_coef = {reward.response_length_penalty_coef}: the length penalty "
                f"is taken off the combined score, which adv_estimator {name} does not read (it normalises the "
                f"components {keys}); set it to 0 or use adv_estimator grpo")))
    for task_key, task in cfg.tasks.items():
        if "format_rate" in keys and not task.format_weight:
            problems.append(error(f"tasks.{task_key}.format_weight", (
                f"tasks.{task_key}.format_weight is 0 but gdpo_reward_keys names format_rate: GDPO normalises the "
                f"format apart and would reward it anyway; set a format_weight > 0 to reward the <answer> format, "
                f"or gdpo_reward_keys: [accuracy]")))
    shaping = {"reward_norm": cfg.reward_norm is not None, "reward_clip": cfg.reward_clip is not None,
               "add_token_level_kl": cfg.add_token_level_kl}
    for key in SCORE_SHAPING:
        if shaping[key]:
            problems.append(error(key, f"{key} = {getattr(cfg, key)!r} acts on the combined score, which "
                                       f"adv_estimator {name} does not read (it normalises the components {keys} "
                                       f"and whitens their sum itself); drop {key} or use adv_estimator grpo"))
    return problems


@check("warn", keys=("adv_estimator", "gdpo_reward_keys", "rewards.<domain>.worker_cls", "tasks.<key>.partial_credit"),
       doc="`adv_estimator: gdpo`: a user's reward worker, whose components are seen only when it runs; a task "
           "with partial_credit while its `accuracy` component pays no part credit",
       name="rewards.gdpo_unknown_components", rollout_only=True)
def _gdpo_unknown_components(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    estimator = ESTIMATORS.get(cfg.adv_estimator)
    if cfg.pipeline != "rlvr" or estimator is None or not estimator.components:
        return []
    keys = list(cfg.gdpo_reward_keys)
    found: List[Finding] = []
    for domain, reward in cfg.rewards.items():
        if kind_of(reward.worker_cls) is None or reward.worker_cls.rpartition(".")[2] in USER_SCORED:
            found.append(warning(f"rewards.{domain}.worker_cls", (
                f"adv_estimator {cfg.adv_estimator}: rewards.{domain}.worker_cls {reward.worker_cls} is checked for "
                f"the components {keys} only when it scores; a response it scores without reporting them (a "
                f"ScoreWithMetrics) stops the step, naming the key")))
    for task_key, task in cfg.tasks.items():
        if task.partial_credit and "accuracy" in keys:
            found.append(warning(f"tasks.{task_key}.partial_credit", (
                f"tasks.{task_key}.partial_credit pays near misses in the combined score, but GDPO's accuracy "
                f"component is 0 or 1; name answer_score in gdpo_reward_keys to normalise the task's own score")))
    return found
