"""Checks and derived defaults of `pipeline: agentic` (ROLL's agentic keys): env managers and their
batch arithmetic, the environments and tools they name (built at --dry-run? no: checked against
their constructors' signatures), templates, advantages, and the keys an agentic run does not read.
"""
from __future__ import annotations

import copy
import string
from typing import AbstractSet, List, Optional

from roll_gspo.catalog.estimators import ESTIMATORS, names
from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.config.checks.registry import check
from roll_gspo.config.checks.role_reads import is_written
from roll_gspo.config.plan.agentic import ENV_MANAGER_CLASSES, env_manager_kind
from roll_gspo.config.plan.endpoint import uses_agent
from roll_gspo.schema.config import CustomEnvConfig, EnvManagerConfig, PipelineConfig

TEMPLATE_FIELDS = {"observation", "turn_idx", "actions_left", "max_response_length", "suffix"}


AGENTIC_KEYS = ("custom_envs", "train_env_manager", "val_env_manager")


@check("normalise", keys=("pipeline",), doc="a config writing custom_envs / train_env_manager / val_env_manager "
       "and no `pipeline` is an agentic one (said in a notice)", name="agentic.pipeline")
def infer_agentic_pipeline(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """ROLL chooses the pipeline by its start script, so its agentic YAMLs have no `pipeline` key: a
    config that writes the agentic blocks and no `pipeline` is an agentic one (said in a notice)."""
    if yaml_keys is None or "pipeline" in yaml_keys or cfg.pipeline != "rlvr":
        return []
    written = [key for key in AGENTIC_KEYS if key in yaml_keys]
    if not written:
        return []
    cfg.pipeline = "agentic"
    return [notice("pipeline", f"pipeline: agentic, since the config writes {', '.join(written)} and no `pipeline` "
                               f"(ROLL picks it by the start script); write `pipeline: agentic` to silence this")]


# The keys that shape the sampling distribution. The trainer, the reference, vLLM's logprobs_mode,
# the exactness of the rollout log-probs and the async checks all read actor_infer's; the training
# episodes sample with train_env_manager's. So the two must be one set (ROLL's AgenticConfig makes
# them so; it drops the manager's silently when actor_infer writes its own).
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


@check("derive", keys=("num_return_sequences_in_group", "rewards", "train_env_manager.generating_args",
                       "val_env_manager.generating_args", "actor_infer.generating_args", "loss_norm_length",
                       "response_length"),
       doc="agentic: one sample per request (groups come from group_size), no reward workers, the managers' "
           "sampling and lengths from actor_infer's and sequence_length; sampling keys written for the training "
           "episodes only are actor_infer's too (said in a notice)", name="agentic.defaults")
def _agentic_defaults(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if cfg.pipeline == "agentic":
        fill_agentic_defaults(cfg)
        return share_training_sampling(cfg, yaml_keys)
    return []


def fill_agentic_defaults(cfg: PipelineConfig) -> None:
    """ROLL's agentic semantics, in place: one sample per request (groups come from group_size), no
    prompt data nor reward workers (rewards come from the envs), per-turn caps from the managers."""
    cfg.num_return_sequences_in_group = 1
    cfg.rewards = {}
    gen = cfg.actor_infer.generating_args
    gen.num_return_sequences = 1
    if gen.max_new_tokens is None:
        gen.max_new_tokens = cfg.sequence_length
    for manager in (cfg.train_env_manager, cfg.val_env_manager):
        if manager.generating_args is None:
            manager.generating_args = copy.deepcopy(gen)
        manager.generating_args.num_return_sequences = 1
        if manager.generating_args.max_new_tokens is None:
            manager.generating_args.max_new_tokens = cfg.sequence_length
    if cfg.loss_norm_length is None:
        cfg.loss_norm_length = cfg.sequence_length
    cfg.response_length = min(cfg.response_length, cfg.sequence_length)  # read by length checks only


def share_training_sampling(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]]) -> List[Finding]:
    """In place: make the training episodes' sampling keys and actor_infer's one set. A key the
    YAML writes on one side only is copied to the other (ROLL: actor_infer takes the manager's
    when it has none); one written on both sides with two values is refused by
    `training_sampling_problems`. Without the YAML's keys (a config built in code) nothing is
    copied. Returns the notice naming what actor_infer took."""
    if yaml_keys is None:
        return []
    infer, train = cfg.actor_infer.generating_args, cfg.train_env_manager.generating_args
    taken = []
    for key in SAMPLING_KEYS:
        by_manager = writes_leaf(f"train_env_manager.generating_args.{key}", yaml_keys)
        by_infer = writes_leaf(f"actor_infer.generating_args.{key}", yaml_keys)
        if by_manager and not by_infer and getattr(infer, key) != getattr(train, key):
            setattr(infer, key, getattr(train, key))
            taken.append(f"{key} = {getattr(train, key)}")
        elif by_infer and not by_manager:
            setattr(train, key, getattr(infer, key))
    if not taken:
        return []
    return [notice("actor_infer.generating_args", f"actor_infer.generating_args takes train_env_manager's "
                                                  f"{', '.join(taken)}: the trainer, the reference and the rollout's "
                                                  f"log-probs must use the sampling the episodes are played with")]


def writes_leaf(path: str, yaml_keys: AbstractSet[str]) -> bool:
    """True when the YAML writes `path` itself, or a block above it as one value (an
    interpolation such as `generating_args: ${actor_infer.generating_args}`); a block written key by
    key does not write the keys it leaves out (`is_written` counts those too)."""
    parts = path.split(".")
    for depth in range(1, len(parts)):
        block = ".".join(parts[:depth])
        if block in yaml_keys and not any(key.startswith(block + ".") for key in yaml_keys):
            return True
    return path in yaml_keys


@check("check", keys=("train_env_manager.generating_args", "actor_infer.generating_args"),
       doc="agentic: the training episodes' temperature / top_p / top_k differ from actor_infer's (the trainer would "
           "score other probabilities than the episodes sampled)", name="agentic.sampling")
def training_sampling_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """A difference left after `share_training_sampling` was written on both sides: refused (ROLL
    keeps actor_infer's and drops the manager's without a word)."""
    if cfg.pipeline != "agentic" or cfg.train_env_manager.generating_args is None:
        return []
    infer, train = cfg.actor_infer.generating_args, cfg.train_env_manager.generating_args
    return [error(f"train_env_manager.generating_args.{key}",
                  f"train_env_manager.generating_args.{key} = {getattr(train, key)} differs from "
                  f"actor_infer.generating_args.{key} = {getattr(infer, key)}: the episodes would be sampled with "
                  f"one and scored (trainer, reference, rollout log-probs) with the other, so every ratio starts "
                  f"off 1. Write it once (either block) or give both the same value")
            for key in SAMPLING_KEYS if getattr(train, key) != getattr(infer, key)]


@check("derive", keys=("importance_sampling",), doc="agentic `step_reinforce` on whole-trajectory samples with "
       "importance_sampling not written: ROLL's `token` (said in a notice)", name="agentic.ratio",
       after=("defaults.derived",))
def fill_agentic_ratio(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """In place: `step_reinforce` on whole-trajectory samples with importance_sampling not written
    takes ROLL's default ratio, `token` (this project's default, `seq`, is refused there:
    `agentic_problems`). Returns the notice to log."""
    if (cfg.pipeline != "agentic" or not _turn_credit_in_one_sample(cfg) or cfg.importance_sampling != "seq"
            or yaml_keys is None or "importance_sampling" in yaml_keys):
        return []
    cfg.importance_sampling = "token"
    return [notice("importance_sampling", "adv_estimator: step_reinforce on whole-trajectory samples with "
                                          "importance_sampling not set: token (ROLL's per-token ratio); this project's "
                                          "default, seq, is refused there")]


def _turn_credit_in_one_sample(cfg: PipelineConfig) -> bool:
    """step_reinforce with trajectory-wise samples: turns of one sample carry different advantages."""
    estimator = ESTIMATORS.get(cfg.adv_estimator)
    return estimator is not None and estimator.granularity == "turn" and env_manager_kind(cfg) == "traj"


@check("check", keys=AGENTIC_KEYS + ("sequence_length", "val_batch_size", "reward_normalization"),
       doc="the agentic blocks written in an rlvr / sft config", name="agentic.keys_elsewhere")
def agentic_keys_in_other_pipelines(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """The agentic blocks written in an rlvr / sft config act nowhere: refused."""
    if cfg.pipeline == "agentic" or yaml_keys is None:
        return []
    defaults = PipelineConfig()  # a printed config writes every key at its default: those pass
    return [error(key, f"{key}: read only by `pipeline: agentic` (this is a {cfg.pipeline} config); set pipeline: "
                       f"agentic or remove it")
            for key in AGENTIC_KEYS + ("sequence_length", "val_batch_size", "reward_normalization")
            if key in yaml_keys and getattr(cfg, key) != getattr(defaults, key)]


@check("check", keys=("sequence_length", "adv_estimator", "step_reward_gamma", "importance_sampling",
                      "train_env_manager", "val_env_manager", "custom_envs", "reward_normalization",
                      "rollout_batch_size", "<role>.data_args.template"),
       doc="agentic: estimators not built there, `importance_sampling: seq` with step_reinforce on whole-trajectory "
           "samples, env managers naming missing envs or splitting batches unevenly, envs and tools that cannot "
           "be built, mixed env-manager kinds, a mean_std / mean `reward_normalization` over groups of one "
           "trajectory, chat templates differing between roles, prompt and reward keys an agentic run never reads",
       name="agentic.problems")
def agentic_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if cfg.pipeline != "agentic":
        return []
    problems: List[Finding] = []
    if cfg.sequence_length < 2:
        problems.append(error("sequence_length", f"sequence_length: must be >= 2 (the whole trajectory's token "
                                                 f"budget), got {cfg.sequence_length}"))
    agentic_estimators = names("agentic")
    if cfg.adv_estimator not in agentic_estimators:
        problems.append(error("adv_estimator", f"adv_estimator {cfg.adv_estimator!r} is not built for the agentic "
                                               f"pipeline; valid: {', '.join(sorted(agentic_estimators))}"))
    if not 0 <= cfg.step_reward_gamma <= 1:
        problems.append(error("step_reward_gamma",
                              f"step_reward_gamma: must be in [0, 1], got {cfg.step_reward_gamma}"))
    if _turn_credit_in_one_sample(cfg) and cfg.importance_sampling == "seq":
        # One sequence ratio moves every turn of the trajectory together, so each turn is pushed by
        # the mean of all turns' advantages: a bad first move followed by a good one is pushed up.
        problems.append(error("importance_sampling", "importance_sampling: seq with adv_estimator: step_reinforce on "
                                                     "whole-trajectory samples is refused: each turn has its own "
                                                     "advantage, and one sequence ratio over the trajectory pushes "
                                                     "every turn by the mean of them (a bad move before a good one is "
                                                     "reinforced). Use importance_sampling: gspo-token (the sequence "
                                                     "ratio with per-token advantages) or token, or env_manager_cls: "
                                                     "step (a sample per turn, each its own sequence ratio)"))
    for key, why in (("rewards", "rewards come from the environments (custom_envs)"),
                     ("actor_train.data_args.file_name", "episodes come from custom_envs, not a prompt file"),
                     ("validation", "validation plays val_env_manager's episodes")):
        if yaml_keys is not None and any(k == key or k.startswith(key + ".") for k in yaml_keys):
            problems.append(error(key, f"{key}: not read by the agentic pipeline ({why}); remove it"))
    problems += [p for p in _manager_problems(cfg, "train_env_manager", cfg.train_env_manager, cfg.rollout_batch_size,
                                              "rollout_batch_size")
                 if not (uses_agent(cfg) and p.key == "train_env_manager.tags")]  # an agent needs no custom_envs
    if cfg.eval_steps:
        problems += _manager_problems(cfg, "val_env_manager", cfg.val_env_manager, cfg.val_batch_size, "val_batch_size")
    used = dict.fromkeys(cfg.train_env_manager.tags + (cfg.val_env_manager.tags if cfg.eval_steps else []))
    for tag in used:
        if tag in cfg.custom_envs:
            problems += _env_problems(f"custom_envs.{tag}", cfg.custom_envs[tag])
    kinds = {ENV_MANAGER_CLASSES.get(cfg.custom_envs[t].env_manager_cls) for t in cfg.train_env_manager.tags
             if t in cfg.custom_envs}
    if len(kinds - {None}) > 1:
        problems.append(error("train_env_manager.tags", f"train_env_manager.tags {cfg.train_env_manager.tags} mix "
                                                        f"trajectory-wise and step-wise env managers; one batch is one "
                                                        f"kind of sample"))
    group = cfg.train_env_manager.group_size
    if (cfg.reward_normalization.grouping == "traj_group_id" and cfg.reward_normalization.method != "identity"
            and group < 2):
        problems.append(error("reward_normalization", f"reward_normalization: {cfg.reward_normalization.method} over "
                                                      f"groups of train_env_manager.group_size = {group} trajectory "
                                                      f"turns every reward into 0; raise group_size, or use grouping: "
                                                      f"batch / tags, or method: identity"))
    mini = cfg.mini_batch_size()
    if env_manager_kind(cfg) == "traj" and cfg.rollout_batch_size % mini:
        args = cfg.actor_train.training_args
        problems.append(error("rollout_batch_size", f"batch arithmetic: rollout_batch_size = {cfg.rollout_batch_size} "
                                                    f"trajectories per step is not divisible by the mini-batch "
                                                    f"actor_train.training_args.per_device_train_batch_size * "
                                                    f"gradient_accumulation_steps * actor_train.world_size = "
                                                    f"{args.per_device_train_batch_size} * "
                                                    f"{args.gradient_accumulation_steps} * "
                                                    f"{cfg.actor_train.world_size} = {mini}"))
    template = cfg.actor_train.data_args.template
    for role in ("actor_infer", "reference"):
        other = getattr(cfg, role).data_args.template
        if other is not None and other != template:
            problems.append(error(f"{role}.data_args.template", f"{role}.data_args.template = {other!r} differs from "
                                                                f"actor_train.data_args.template = {template!r}: one "
                                                                f"chat template renders the conversation for every "
                                                                f"role"))
    return problems


def _manager_problems(cfg: PipelineConfig, key: str, manager: EnvManagerConfig, batch: int,
                      batch_key: str) -> List[Finding]:
    problems = []
    if not manager.tags:
        problems.append(error(f"{key}.tags", f"{key}.tags: name at least one custom_envs entry"))
    missing = [t for t in manager.tags if t not in cfg.custom_envs]
    if missing:
        problems.append(error(f"{key}.tags", f"{key}.tags: {missing} are not custom_envs entries (defined: "
                                             f"{sorted(cfg.custom_envs)})"))
    if manager.num_groups_partition:
        partition = f"{key}.num_groups_partition"
        if len(manager.num_groups_partition) != len(manager.tags):
            problems.append(error(partition, f"{partition} has {len(manager.num_groups_partition)} entries for "
                                             f"{len(manager.tags)} tags; they are zipped"))
        elif sum(manager.num_groups_partition) != manager.num_env_groups or min(manager.num_groups_partition) < 0:
            problems.append(error(partition, f"{partition} {manager.num_groups_partition} must be >= 0 and sum to "
                                             f"num_env_groups = {manager.num_env_groups}"))
    for name in ("group_size", "num_env_groups"):
        if getattr(manager, name) < 1:
            problems.append(error(f"{key}.{name}", f"{key}.{name}: must be >= 1, got {getattr(manager, name)}"))
    if manager.max_env_num_per_worker < 0:
        problems.append(error(f"{key}.max_env_num_per_worker", f"{key}.max_env_num_per_worker: must be >= 0 (0: one "
                                                               f"thread per episode in flight)"))
    if manager.group_size >= 1 and batch % manager.group_size:
        problems.append(error(batch_key, f"{batch_key} = {batch} is not a multiple of {key}.group_size = "
                                         f"{manager.group_size} (a batch is whole groups)"))
    if batch < 1:
        problems.append(error(batch_key, f"{batch_key}: must be >= 1, got {batch}"))
    return problems


def _env_problems(key: str, env: CustomEnvConfig) -> List[Finding]:
    problems = []
    if env.env_manager_cls not in ENV_MANAGER_CLASSES:
        problems.append(error(f"{key}.env_manager_cls", f"{key}.env_manager_cls = {env.env_manager_cls!r}: not "
                                                        f"built; valid: {', '.join(sorted(ENV_MANAGER_CLASSES))}"))
    for name in ("max_steps", "max_tokens_per_step"):
        if getattr(env, name) < 1:
            problems.append(error(f"{key}.{name}", f"{key}.{name}: must be >= 1, got {getattr(env, name)}"))
    if not env.env_step_timeout_s > 0:
        problems.append(error(f"{key}.env_step_timeout_s", f"{key}.env_step_timeout_s: must be > 0, got "
                                                           f"{env.env_step_timeout_s}"))
    for name in ("agent_template", "agent_system_template"):
        text = getattr(env, name)
        if not text:
            continue
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
        except ValueError as exc:
            problems.append(error(f"{key}.{name}", f"{key}.{name}: not a valid format string ({exc})"))
            continue
        unknown = sorted({f.split(".")[0].split("[")[0] for f in fields} - TEMPLATE_FIELDS - {""})
        if unknown and name == "agent_template":
            problems.append(error(f"{key}.agent_template", f"{key}.agent_template: unknown placeholders {unknown}; "
                                                           f"valid: {sorted(TEMPLATE_FIELDS)} (double braces for "
                                                           f"literal ones)"))
    from roll_gspo.envs.registry import env_problems

    problems += [error(f"{key}.env_config", f"{key}: {p}") for p in env_problems(env.env_type, dict(env.env_config))]
    if env.tool_wrapper is not None and env.tool_wrapper.tool_configs:
        from roll_gspo.envs.tools import wrapper_problems  # the tools' own problems included

        problems += [error(f"{key}.tool_wrapper", f"{key}.tool_wrapper: {p}") for p in wrapper_problems(
            {"wrapper_args": dict(env.tool_wrapper.wrapper_args), "tool_configs": list(env.tool_wrapper.tool_configs)})]
    return problems


@check("warn", keys=("num_return_sequences_in_group", "prompt_length", "response_length", "reward_normalization",
                     "batch_adjust_mode", "train_env_manager.num_env_groups", "val_env_manager.num_env_groups"),
       doc="agentic: keys ROLL's agentic recipes set that act differently or not at all here, ROLL's "
           "reward_normalization defaults when left out, batches that differ from num_env_groups * group_size",
       name="agentic.notices")
def agentic_notices(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Keys ROLL's agentic recipes set that act differently or not at all here: one notice each."""
    if cfg.pipeline != "agentic":
        return []
    defaults = PipelineConfig()
    notices = []
    ignored = {
        "num_return_sequences_in_group": "groups come from train_env_manager.group_size (ROLL forces 1 here too)",
        "prompt_length": "sequence_length (the whole trajectory's budget)",
        "response_length": "sequence_length and custom_envs.<tag>.max_tokens_per_step",
        "train_env_manager.format_penalty": "custom_envs.<tag>.env_config.format_penalty (no code reads it in ROLL)",
        "val_env_manager.format_penalty": "custom_envs.<tag>.env_config.format_penalty (no code reads it in ROLL)",
    }
    for path, instead in ignored.items():
        if yaml_keys is not None and path in yaml_keys:
            notices.append(notice(path, f"{path} is ignored by the agentic pipeline; what acts is {instead}"))
    # ROLL's defaults differ from GRPO's z-score: say which acted when the YAML leaves them out (a
    # block written whole as one interpolation has no leaves here and counts as written).
    written = yaml_keys if yaml_keys is not None else frozenset()
    unset = [k for k in ("grouping", "method") if yaml_keys is not None and f"reward_normalization.{k}" not in written]
    if unset and not (len(unset) == 2 and "reward_normalization" in written):
        norm = cfg.reward_normalization
        notices.append(notice("reward_normalization",
                              f"reward_normalization.{' and '.join(unset)} not set: ROLL's default (grouping: "
                              f"{norm.grouping}, method: "
                              f"{norm.method}{': raw rewards, no baseline' if norm.method == 'identity' else ''}); for "
                              f"GRPO's group z-score write reward_normalization: {{grouping: traj_group_id, method: "
                              f"mean_std}}"))
    if env_manager_kind(cfg) == "traj" and is_written("batch_adjust_mode", yaml_keys) and yaml_keys is not None \
            and "batch_adjust_mode" in yaml_keys and cfg.batch_adjust_mode != defaults.batch_adjust_mode:
        notices.append(notice("batch_adjust_mode", "batch_adjust_mode is ignored with trajectory-wise env managers "
                                                   "(a step is always rollout_batch_size samples)"))
    for key, manager, batch in (("train_env_manager", cfg.train_env_manager, cfg.rollout_batch_size),
                                ("val_env_manager", cfg.val_env_manager, cfg.val_batch_size)):
        if key == "val_env_manager" and (cfg.agent.agent_func or cfg.agent.verifiers_env):  # no validation (refused)
            continue
        if manager.group_size and manager.num_env_groups * manager.group_size != batch:
            notices.append(notice(f"{key}.num_env_groups",
                                  f"{key}.num_env_groups * group_size = {manager.num_env_groups} * "
                                  f"{manager.group_size} differs from "
                                  f"{'rollout' if key.startswith('train') else 'val'}_batch_size = {batch}: a batch "
                                  f"plays {batch // max(manager.group_size, 1)} groups, split over tags in "
                                  f"num_groups_partition's proportions"))
    return notices
