"""How an agentic run plays its episodes, read from its keys: how a trajectory becomes samples (the env
manager's kind), a failed step's reward, a manager's sampling. The checks are
`roll_gspo.config.checks.agentic`'s."""
from __future__ import annotations

from roll_gspo.schema.config import CustomEnvConfig, EnvManagerConfig, GeneratingArgs, PipelineConfig


# ROLL's env manager classes -> how a trajectory becomes samples here.
ENV_MANAGER_CLASSES = {
    "traj": "traj", "step": "step",
    "roll.pipeline.agentic.env_manager.traj_env_manager.TrajEnvManager": "traj",
    "roll.pipeline.agentic.env_manager.step_env_manager.StepEnvManager": "step",
    "roll.pipeline.agentic.env_manager.step_concat_env_manager.StepConcatEnvManager": "step",
}


def env_manager_kind(cfg: PipelineConfig) -> str:
    """`traj` or `step`: how the training tags' episodes become samples (all tags agree)."""
    kinds = {ENV_MANAGER_CLASSES.get(cfg.custom_envs[tag].env_manager_cls) for tag in cfg.train_env_manager.tags
             if tag in cfg.custom_envs}
    known = {kind for kind in kinds if kind is not None}
    return known.pop() if len(known) == 1 else "traj"


def error_penalty(env_cfg: CustomEnvConfig) -> float:
    """Reward of a step that ends an episode because its env failed."""
    if env_cfg.error_penalty is not None:
        return float(env_cfg.error_penalty)
    value = env_cfg.env_config.get("format_penalty", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def manager_generating_args(cfg: PipelineConfig, manager: EnvManagerConfig) -> GeneratingArgs:
    """The manager's sampling, filled (fill_agentic_defaults has run). The training manager's
    temperature / top_p / top_k are actor_infer's (`training_sampling_problems`)."""
    return manager.generating_args or cfg.actor_infer.generating_args
