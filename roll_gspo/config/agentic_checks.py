"""Checks and derived defaults of `pipeline: agentic` (ROLL's agentic keys): env managers and their
batch arithmetic, the environments and tools they name (built at --dry-run? no: checked against
their constructors' signatures), templates, advantages, and the keys an agentic run does not read.
"""
from __future__ import annotations

import copy
import re
import string
from typing import AbstractSet, List, Optional

from roll_gspo.config.role_reads import is_written
from roll_gspo.config.schema import CustomEnvConfig, EnvManagerConfig, GeneratingArgs, PipelineConfig

# ROLL's env manager classes -> how a trajectory becomes samples here.
ENV_MANAGER_CLASSES = {
    "traj": "traj", "step": "step",
    "roll.pipeline.agentic.env_manager.traj_env_manager.TrajEnvManager": "traj",
    "roll.pipeline.agentic.env_manager.step_env_manager.StepEnvManager": "step",
    "roll.pipeline.agentic.env_manager.step_concat_env_manager.StepConcatEnvManager": "step",
}
AGENTIC_ADV_ESTIMATORS = ("grpo", "reinforce", "step_reinforce")
TEMPLATE_FIELDS = {"observation", "turn_idx", "actions_left", "max_response_length", "suffix"}
# unread_key_problems lines an agentic run replaces by its own check (the conversation's template).
AGENTIC_TEMPLATE_KEYS = re.compile(r"^(actor_infer|reference)\.data_args\.template ")


AGENTIC_KEYS = ("custom_envs", "train_env_manager", "val_env_manager")


def infer_agentic_pipeline(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    """ROLL chooses the pipeline by its start script, so its agentic YAMLs have no `pipeline` key: a
    config that writes the agentic blocks and no `pipeline` is an agentic one (said in a notice)."""
    if yaml_keys is None or "pipeline" in yaml_keys or cfg.pipeline != "rlvr":
        return []
    written = [key for key in AGENTIC_KEYS if key in yaml_keys]
    if not written:
        return []
    cfg.pipeline = "agentic"
    return [f"notice: pipeline: agentic, since the config writes {', '.join(written)} and no `pipeline` (ROLL "
            f"picks it by the start script); write `pipeline: agentic` to silence this"]


def env_manager_kind(cfg: PipelineConfig) -> str:
    """`traj` or `step`: how the training tags' episodes become samples (all tags agree)."""
    kinds = {ENV_MANAGER_CLASSES.get(cfg.custom_envs[tag].env_manager_cls) for tag in cfg.train_env_manager.tags
             if tag in cfg.custom_envs}
    kinds.discard(None)
    return kinds.pop() if len(kinds) == 1 else "traj"


def error_penalty(env_cfg: CustomEnvConfig) -> float:
    """Reward of a step that ends an episode because its env failed."""
    if env_cfg.error_penalty is not None:
        return float(env_cfg.error_penalty)
    value = env_cfg.env_config.get("format_penalty", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def manager_generating_args(cfg: PipelineConfig, manager: EnvManagerConfig) -> GeneratingArgs:
    """The manager's sampling, filled (fill_agentic_defaults has run)."""
    return manager.generating_args or cfg.actor_infer.generating_args


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


def fill_agentic_ratio(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    """In place: `step_reinforce` on whole-trajectory samples with importance_sampling not written
    takes ROLL's default ratio, `token` (this project's default, `seq`, is refused there:
    `agentic_problems`). Returns the notice to log."""
    if (cfg.pipeline != "agentic" or not _turn_credit_in_one_sample(cfg) or cfg.importance_sampling != "seq"
            or yaml_keys is None or "importance_sampling" in yaml_keys):
        return []
    cfg.importance_sampling = "token"
    return ["notice: adv_estimator: step_reinforce on whole-trajectory samples with importance_sampling not set: "
            "token (ROLL's per-token ratio); this project's default, seq, is refused there"]


def _turn_credit_in_one_sample(cfg: PipelineConfig) -> bool:
    """step_reinforce with trajectory-wise samples: turns of one sample carry different advantages."""
    return cfg.adv_estimator == "step_reinforce" and env_manager_kind(cfg) == "traj"


def agentic_keys_in_other_pipelines(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    """The agentic blocks written in an rlvr / sft config act nowhere: refused."""
    if cfg.pipeline == "agentic" or yaml_keys is None:
        return []
    defaults = PipelineConfig()  # a printed config writes every key at its default: those pass
    return [f"{key}: read only by `pipeline: agentic` (this is a {cfg.pipeline} config); set pipeline: agentic "
            f"or remove it" for key in AGENTIC_KEYS + ("sequence_length", "val_batch_size", "reward_normalization")
            if key in yaml_keys and getattr(cfg, key) != getattr(defaults, key)]


def agentic_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    problems: List[str] = []
    if cfg.sequence_length < 2:
        problems.append(f"sequence_length: must be >= 2 (the whole trajectory's token budget), got {cfg.sequence_length}")
    if cfg.adv_estimator not in AGENTIC_ADV_ESTIMATORS:
        problems.append(f"adv_estimator {cfg.adv_estimator!r} is not built for the agentic pipeline; valid: "
                        f"{', '.join(AGENTIC_ADV_ESTIMATORS)}")
    if not 0 <= cfg.step_reward_gamma <= 1:
        problems.append(f"step_reward_gamma: must be in [0, 1], got {cfg.step_reward_gamma}")
    if _turn_credit_in_one_sample(cfg) and cfg.importance_sampling == "seq":
        # One sequence ratio moves every turn of the trajectory together, so each turn is pushed by
        # the mean of all turns' advantages: a bad first move followed by a good one is pushed up.
        problems.append("importance_sampling: seq with adv_estimator: step_reinforce on whole-trajectory samples "
                        "is refused: each turn has its own advantage, and one sequence ratio over the trajectory "
                        "pushes every turn by the mean of them (a bad move before a good one is reinforced). Use "
                        "importance_sampling: gspo-token (the sequence ratio with per-token advantages) or token, "
                        "or env_manager_cls: step (a sample per turn, each its own sequence ratio)")
    if cfg.async_generation_ratio:
        problems.append("async_generation_ratio: the agentic pipeline plays its episodes synchronously (environments "
                        "already step while the engine generates); generating a step ahead is not built, use 0")
    for key, why in (("rewards", "rewards come from the environments (custom_envs)"),
                     ("actor_train.data_args.file_name", "episodes come from custom_envs, not a prompt file"),
                     ("validation", "validation plays val_env_manager's episodes")):
        if yaml_keys is not None and any(k == key or k.startswith(key + ".") for k in yaml_keys):
            problems.append(f"{key}: not read by the agentic pipeline ({why}); remove it")
    problems += _manager_problems(cfg, "train_env_manager", cfg.train_env_manager, cfg.rollout_batch_size,
                                  "rollout_batch_size")
    if cfg.eval_steps:
        problems += _manager_problems(cfg, "val_env_manager", cfg.val_env_manager, cfg.val_batch_size, "val_batch_size")
    used = dict.fromkeys(cfg.train_env_manager.tags + (cfg.val_env_manager.tags if cfg.eval_steps else []))
    for tag in used:
        if tag in cfg.custom_envs:
            problems += _env_problems(f"custom_envs.{tag}", cfg.custom_envs[tag])
    kinds = {ENV_MANAGER_CLASSES.get(cfg.custom_envs[t].env_manager_cls) for t in cfg.train_env_manager.tags
             if t in cfg.custom_envs}
    if len(kinds - {None}) > 1:
        problems.append(f"train_env_manager.tags {cfg.train_env_manager.tags} mix trajectory-wise and step-wise "
                        f"env managers; one batch is one kind of sample")
    group = cfg.train_env_manager.group_size
    if (cfg.reward_normalization.grouping == "traj_group_id" and cfg.reward_normalization.method != "identity"
            and group < 2):
        problems.append(f"reward_normalization: {cfg.reward_normalization.method} over groups of "
                        f"train_env_manager.group_size = {group} trajectory turns every reward into 0; raise "
                        f"group_size, or use grouping: batch / tags, or method: identity")
    mini = cfg.mini_batch_size()
    if env_manager_kind(cfg) == "traj" and cfg.rollout_batch_size % mini:
        args = cfg.actor_train.training_args
        problems.append(f"batch arithmetic: rollout_batch_size = {cfg.rollout_batch_size} trajectories per step is "
                        f"not divisible by the mini-batch actor_train.training_args.per_device_train_batch_size * "
                        f"gradient_accumulation_steps * actor_train.world_size = {args.per_device_train_batch_size} "
                        f"* {args.gradient_accumulation_steps} * {cfg.actor_train.world_size} = {mini}")
    template = cfg.actor_train.data_args.template
    for role in ("actor_infer", "reference"):
        other = getattr(cfg, role).data_args.template
        if other is not None and other != template:
            problems.append(f"{role}.data_args.template = {other!r} differs from actor_train.data_args.template = "
                            f"{template!r}: one chat template renders the conversation for every role")
    return problems


def _manager_problems(cfg: PipelineConfig, key: str, manager: EnvManagerConfig, batch: int, batch_key: str) -> List[str]:
    problems = []
    if not manager.tags:
        problems.append(f"{key}.tags: name at least one custom_envs entry")
    missing = [t for t in manager.tags if t not in cfg.custom_envs]
    if missing:
        problems.append(f"{key}.tags: {missing} are not custom_envs entries (defined: {sorted(cfg.custom_envs)})")
    if manager.num_groups_partition:
        if len(manager.num_groups_partition) != len(manager.tags):
            problems.append(f"{key}.num_groups_partition has {len(manager.num_groups_partition)} entries for "
                            f"{len(manager.tags)} tags; they are zipped")
        elif sum(manager.num_groups_partition) != manager.num_env_groups or min(manager.num_groups_partition) < 0:
            problems.append(f"{key}.num_groups_partition {manager.num_groups_partition} must be >= 0 and sum to "
                            f"num_env_groups = {manager.num_env_groups}")
    for name in ("group_size", "num_env_groups"):
        if getattr(manager, name) < 1:
            problems.append(f"{key}.{name}: must be >= 1, got {getattr(manager, name)}")
    if manager.max_env_num_per_worker < 0:
        problems.append(f"{key}.max_env_num_per_worker: must be >= 0 (0: one thread per episode in flight)")
    if manager.group_size >= 1 and batch % manager.group_size:
        problems.append(f"{batch_key} = {batch} is not a multiple of {key}.group_size = {manager.group_size} "
                        f"(a batch is whole groups)")
    if batch < 1:
        problems.append(f"{batch_key}: must be >= 1, got {batch}")
    return problems


def _env_problems(key: str, env: CustomEnvConfig) -> List[str]:
    problems = []
    if env.env_manager_cls not in ENV_MANAGER_CLASSES:
        problems.append(f"{key}.env_manager_cls = {env.env_manager_cls!r}: not built; valid: "
                        f"{', '.join(sorted(ENV_MANAGER_CLASSES))}")
    for name in ("max_steps", "max_tokens_per_step"):
        if getattr(env, name) < 1:
            problems.append(f"{key}.{name}: must be >= 1, got {getattr(env, name)}")
    if not env.env_step_timeout_s > 0:
        problems.append(f"{key}.env_step_timeout_s: must be > 0, got {env.env_step_timeout_s}")
    for name in ("agent_template", "agent_system_template"):
        text = getattr(env, name)
        if not text:
            continue
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
        except ValueError as exc:
            problems.append(f"{key}.{name}: not a valid format string ({exc})")
            continue
        unknown = sorted({f.split(".")[0].split("[")[0] for f in fields} - TEMPLATE_FIELDS - {""})
        if unknown and name == "agent_template":
            problems.append(f"{key}.agent_template: unknown placeholders {unknown}; valid: {sorted(TEMPLATE_FIELDS)} "
                            f"(double braces for literal ones)")
    from roll_gspo.envs.registry import env_problems

    problems += [f"{key}: {p}" for p in env_problems(env.env_type, dict(env.env_config))]
    if env.tool_wrapper is not None and env.tool_wrapper.tool_configs:
        from roll_gspo.envs.tools import wrapper_problems  # the tools' own problems included

        problems += [f"{key}.tool_wrapper: {p}" for p in wrapper_problems(
            {"wrapper_args": dict(env.tool_wrapper.wrapper_args), "tool_configs": list(env.tool_wrapper.tool_configs)})]
    return problems


def agentic_notices(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    """Keys ROLL's agentic recipes set that act differently or not at all here: one notice each."""
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
            notices.append(f"notice: {path} is ignored by the agentic pipeline; what acts is {instead}")
    # ROLL's defaults differ from GRPO's z-score: say which acted when the YAML leaves them out (a
    # block written whole as one interpolation has no leaves here and counts as written).
    unset = [k for k in ("grouping", "method") if yaml_keys is not None and f"reward_normalization.{k}" not in yaml_keys]
    if unset and not (len(unset) == 2 and "reward_normalization" in yaml_keys):
        norm = cfg.reward_normalization
        notices.append(f"notice: reward_normalization.{' and '.join(unset)} not set: ROLL's default "
                       f"(grouping: {norm.grouping}, method: {norm.method}"
                       f"{': raw rewards, no baseline' if norm.method == 'identity' else ''}); for GRPO's group "
                       f"z-score write reward_normalization: {{grouping: traj_group_id, method: mean_std}}")
    if env_manager_kind(cfg) == "traj" and is_written("batch_adjust_mode", yaml_keys) and yaml_keys is not None \
            and "batch_adjust_mode" in yaml_keys and cfg.batch_adjust_mode != defaults.batch_adjust_mode:
        notices.append("notice: batch_adjust_mode is ignored with trajectory-wise env managers (a step is always "
                       "rollout_batch_size samples)")
    for key, manager, batch in (("train_env_manager", cfg.train_env_manager, cfg.rollout_batch_size),
                                ("val_env_manager", cfg.val_env_manager, cfg.val_batch_size)):
        if manager.group_size and manager.num_env_groups * manager.group_size != batch:
            notices.append(f"notice: {key}.num_env_groups * group_size = {manager.num_env_groups} * "
                           f"{manager.group_size} differs from {'rollout' if key.startswith('train') else 'val'}"
                           f"_batch_size = {batch}: a batch plays {batch // max(manager.group_size, 1)} groups, split "
                           f"over tags in num_groups_partition's proportions")
    return notices

