"""Checks of the `warm_start` block (rejection-sampling fine-tuning before RL, pipelines/rft_warm_start.py),
before any worker starts: the pipeline that runs it, its numbers, an adapter it would apply twice, and
a reward the driver can compute itself (the warm start scores its samples before any reward worker
exists, so a judge or reward model, a sandbox or IFEval's batch scorer cannot score them)."""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.catalog.reward_workers import kind_of
from roll_gspo.config.findings import Finding, error
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig

# Built-in workers whose reward is a plain function (`build_reward_fn`) the driver can call.
DRIVER_SCORED = ("TaskRewardWorker", "MathRuleRewardWorker", "RegexMatchRewardWorker", "FunctionRewardWorker",
                 "MultipleChoiceRewardWorker")


def training_reward_blocks(cfg: PipelineConfig) -> List[str]:
    """The reward blocks that score training rows: the tasks' (weight > 0) with `tasks`, else every block
    (a data file's rows name their domain only when read)."""
    if cfg.tasks:
        return list(dict.fromkeys(t.reward for t in cfg.tasks.values() if t.weight > 0))
    return list(cfg.rewards)


def scored_in_driver(worker_cls: str) -> Optional[bool]:
    """Whether a worker's reward is a plain function: a built-in rule worker, or a class of the user's that
    leaves `score_responses` to the base class (None: the class cannot be imported; preflight says why)."""
    kind = kind_of(worker_cls)
    if kind is not None and worker_cls.startswith("roll_gspo."):
        return kind.name in DRIVER_SCORED
    from roll_gspo.utils.imports import import_object

    try:
        cls = import_object(worker_cls)
    except Exception:  # noqa: BLE001 - preflight reports an unimportable worker
        return None
    own = [c for c in cls.__mro__ if c.__name__ != "RewardWorker" and "score_responses" in vars(c)]
    model = any(getattr(c, "kind", None) is not None and c.kind.loads_model for c in cls.__mro__)
    return not own and not model and any(c.__name__ == "RewardWorker" for c in cls.__mro__)


@check("check", keys=("warm_start.enabled", "warm_start.prompts", "warm_start.samples_per_prompt",
                      "warm_start.temperature", "warm_start.kept_per_prompt", "warm_start.learning_rate",
                      "warm_start.num_train_epochs", "warm_start.per_device_train_batch_size",
                      "warm_start.gradient_accumulation_steps", "actor_train.model_args.adapter_name_or_path",
                      "rewards.<domain>.worker_cls"),
       doc="`warm_start.enabled` outside `pipeline: rlvr`, its counts below 1, a temperature or learning rate "
           "not above 0, more kept replies than samples, an `adapter_name_or_path` (the fine-tuning merges the "
           "adapter, RL would apply it again), a training reward the driver cannot compute (a judge or reward "
           "model, the code sandbox, IFEval)", name="warm_start.problems")
def warm_start_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    ws = cfg.warm_start
    if not ws.enabled:
        return []
    if cfg.pipeline != "rlvr":
        why = ("the sft pipeline is the fine-tuning itself: give it the data" if cfg.pipeline == "sft" else
               "episodes have no single reply to keep (the agentic models' warm starts are "
               "pipelines/agentic_warm_start.py)")
        return [error("warm_start.enabled", f"warm_start.enabled: runs before an RL run of `pipeline: rlvr` only "
                                            f"(this is `pipeline: {cfg.pipeline}`: {why})")]
    problems: List[Finding] = []
    for key in ("prompts", "samples_per_prompt", "kept_per_prompt", "num_train_epochs",
                "per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(ws, key)
        if value is not None and value < 1:
            problems.append(error(f"warm_start.{key}", f"warm_start.{key} = {value}: must be >= 1"))
    for key in ("temperature", "learning_rate"):
        if getattr(ws, key) <= 0:
            problems.append(error(f"warm_start.{key}", f"warm_start.{key} = {getattr(ws, key)}: must be > 0 "
                                                       f"(the warm start keeps some of several distinct samples)"
                                  if key == "temperature" else
                                  f"warm_start.{key} = {getattr(ws, key)}: must be > 0"))
    if ws.kept_per_prompt > ws.samples_per_prompt >= 1:
        problems.append(error("warm_start.kept_per_prompt", f"warm_start.kept_per_prompt = {ws.kept_per_prompt}: "
                                                            f"more than warm_start.samples_per_prompt = "
                                                            f"{ws.samples_per_prompt} replies sampled per prompt"))
    if cfg.actor_train.model_args.adapter_name_or_path:
        problems.append(error("actor_train.model_args.adapter_name_or_path",
                              f"actor_train.model_args.adapter_name_or_path = "
                              f"{cfg.actor_train.model_args.adapter_name_or_path!r} with warm_start.enabled: the "
                              f"warm start fine-tunes that adapter and merges it into its model, which RL would "
                              f"then load the adapter on again; merge the adapter into a model folder first "
                              f"(its final_model/) and name that as `pretrain`, or turn the warm start off"))
    for name in training_reward_blocks(cfg):
        reward = cfg.rewards.get(name)
        if reward is None:
            continue  # the tasks' checks name a missing block
        if scored_in_driver(reward.worker_cls) is False:
            problems.append(error(f"rewards.{name}.worker_cls",
                                  f"rewards.{name}.worker_cls = {reward.worker_cls!r} with warm_start.enabled: the "
                                  f"warm start scores its samples in the driver, before any worker starts, and "
                                  f"this reward needs its worker (a model, a sandbox or a batch scorer); the warm "
                                  f"start takes `tasks` or the {', '.join(DRIVER_SCORED[1:])} (or a subclass "
                                  f"with its own build_reward_fn only); turn warm_start.enabled off for this run"))
    return problems
