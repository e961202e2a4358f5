"""Checks of PPO with a critic (`adv_estimator: gae` and the `critic` block), before any worker starts."""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.catalog.estimators import ESTIMATORS
from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import TRAIN_STRATEGIES, PipelineConfig

# model_type values that name a value head in ROLL's critic blocks; all load the same value model here.
CRITIC_MODEL_TYPES = (None, "trl", "auto_token_classification")


def _needs_critic(cfg: PipelineConfig) -> bool:
    """The estimator reads a critic's values (PPO's gae); an unknown name was refused at loading."""
    estimator = ESTIMATORS.get(cfg.adv_estimator)
    return estimator is not None and estimator.needs_critic


@check("derive", keys=("critic.model_args.model_name_or_path", "critic.strategy_args.strategy_name",
                       "importance_sampling"),
       doc="the critic's model follows `pretrain` and its engine defaults to deepspeed_train; gae with "
           "importance_sampling not written takes ROLL's `token` (said in a notice)", name="critic.defaults",
       after=("defaults.derived",))
def fill_critic_defaults(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """In place: the critic's model follows `pretrain` when it names none (as the policy roles do),
    its engine defaults to deepspeed_train; with gae and importance_sampling not written, the
    ratio is ROLL's default, `token` (this project's default, GSPO's `seq`, is refused with gae).
    Returns the notices to log."""
    notices = []
    if cfg.critic is not None:
        cfg.critic.model_args.model_name_or_path = cfg.critic.model_args.model_name_or_path or cfg.pretrain
        if not cfg.critic.strategy_args.strategy_name:
            cfg.critic.strategy_args.strategy_name = "deepspeed_train"
    if (cfg.pipeline == "rlvr" and _needs_critic(cfg) and cfg.importance_sampling == "seq"
            and yaml_keys is not None and "importance_sampling" not in yaml_keys):
        cfg.importance_sampling = "token"
        notices.append(notice("importance_sampling", "adv_estimator: gae with importance_sampling not set: token "
                                                     "(PPO's per-token ratio, ROLL's default); this project's default, "
                                                     "seq, is refused with gae"))
    return notices


@check("check", keys=("adv_estimator", "critic", "importance_sampling", "gamma", "lambd", "critic_warmup",
                      "value_clip"),
       doc="PPO with a critic: gae without a `critic` block or a critic without gae, gae with `importance_sampling: "
           "seq`, `gamma` / `lambd` outside [0, 1], a `critic_warmup` that leaves the actor untrained, a critic "
           "that is not a trainable engine or does not divide the batch", name="critic.problems")
def critic_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Refusals: gae without a critic and a critic without gae, gae with sequence-level ratios,
    out-of-range gamma / lambd / critic_warmup, a critic that is not a trainable engine."""
    problems: List[Finding] = []
    gae = _needs_critic(cfg)
    if cfg.pipeline != "rlvr":
        if cfg.critic is not None:
            problems.append(error("critic", f"critic: a critic is built for the rlvr pipeline only (adv_estimator: "
                                            f"gae); pipeline {cfg.pipeline!r} does not start one. Remove the block"))
        return problems
    if gae and cfg.critic is None:
        problems.append(error("adv_estimator", "adv_estimator: gae needs a `critic` block (the value model's ranks: "
                                               "model_args, training_args, strategy_args deepspeed_train or "
                                               "fsdp2_train, world_size), as in ROLL; add one "
                                               "(examples/example_ppo.yaml) or use grpo / rloo / reinforce"))
    if cfg.critic is not None and not gae:
        # Refused rather than ignored: it would load and hold a model (memory, start-up time) that
        # nothing reads, and the user most likely meant to run PPO.
        problems.append(error("critic", f"critic: the block is set but adv_estimator is {cfg.adv_estimator!r}; only "
                                        f"gae reads values, so a critic would load and train for nothing. Set "
                                        f"adv_estimator: gae, or remove the critic block"))
    if not gae:
        return problems
    if cfg.importance_sampling == "seq":
        problems.append(error("importance_sampling", "importance_sampling: seq with adv_estimator: gae is refused: GAE "
                                                     "gives every token its own advantage, and GSPO's sequence-level "
                                                     "ratio multiplies the whole response by one ratio, so the "
                                                     "per-token credit would be averaged away in the clip. Use "
                                                     "importance_sampling: token (PPO's per-token ratio) or gspo-token "
                                                     "(the sequence ratio with per-token advantages)"))
    for key in ("gamma", "lambd"):
        value = getattr(cfg, key)
        if not 0.0 <= value <= 1.0:
            problems.append(error(key, f"{key}: must be in [0, 1], got {value}"))
    if cfg.critic_warmup < 0:
        problems.append(error("critic_warmup", f"critic_warmup: must be >= 0, got {cfg.critic_warmup}"))
    elif cfg.max_steps and cfg.critic_warmup >= cfg.max_steps:
        problems.append(error("critic_warmup", f"critic_warmup = {cfg.critic_warmup} >= max_steps = {cfg.max_steps}: "
                                               f"the actor would never train (it trains from step critic_warmup + 1); "
                                               f"lower critic_warmup"))
    if cfg.value_clip is not None and cfg.value_clip <= 0:
        problems.append(error("value_clip", f"value_clip: must be > 0 or null, got {cfg.value_clip}"))
    critic = cfg.critic
    if critic is None:
        return problems
    if critic.strategy_args.strategy_name not in TRAIN_STRATEGIES:
        problems.append(error("critic.strategy_args.strategy_name", f"critic.strategy_args.strategy_name: the critic "
                                                                    f"trains; must be one of {TRAIN_STRATEGIES}, got "
                                                                    f"{critic.strategy_args.strategy_name!r}"))
    if critic.model_args.model_type not in CRITIC_MODEL_TYPES:
        problems.append(error("critic.model_args.model_type", f"critic.model_args.model_type = "
                                                              f"{critic.model_args.model_type!r}: the critic is a "
                                                              f"value model (a scalar per token); use null, trl or "
                                                              f"auto_token_classification"))
    if critic.model_args.uses_lora():
        problems.append(error("critic.model_args.lora_target", "critic.model_args.lora_target: a LoRA critic is not "
                                                               "built; the critic trains every weight (remove the LoRA "
                                                               "keys from the critic block)"))
    for key in ("world_size", "infer_batch_size"):
        if getattr(critic, key) < 1:
            problems.append(error(f"critic.{key}", f"critic.{key}: must be >= 1, got {getattr(critic, key)}"))
    args = critic.training_args
    if args.per_device_train_batch_size < 1 or args.gradient_accumulation_steps < 1:
        problems.append(error("critic.training_args.per_device_train_batch_size",
                              "critic.training_args.per_device_train_batch_size and gradient_accumulation_steps: must "
                              "be >= 1"))
        return problems
    batch = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    mini = cfg.critic_mini_batch_size()
    if batch % mini:
        problems.append(error("critic.training_args.per_device_train_batch_size",
                              f"batch arithmetic: {batch} responses per step (rollout_batch_size * "
                              f"num_return_sequences_in_group) is not divisible by the critic's mini-batch "
                              f"critic.training_args.per_device_train_batch_size * gradient_accumulation_steps * "
                              f"critic.world_size = {args.per_device_train_batch_size} * "
                              f"{args.gradient_accumulation_steps} * {critic.world_size} = {mini}"))
    return problems
