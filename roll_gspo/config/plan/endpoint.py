"""Whether a run serves the rollout endpoint and whose episodes it plays (`rollout_endpoint`, `agent`).
The keys' rules are `roll_gspo.config.checks.endpoint`'s (docs/endpoint.md)."""
from __future__ import annotations

from roll_gspo.schema.config import PipelineConfig


def uses_agent(cfg: PipelineConfig) -> bool:
    """The agentic run's episodes are an agent's (`agent.agent_func` or a verifiers environment,
    `agent.verifiers_env`), not custom_envs'."""
    return cfg.pipeline == "agentic" and bool(cfg.agent.agent_func or cfg.agent.verifiers_env)


def uses_verifiers(cfg: PipelineConfig) -> bool:
    """The agent is a verifiers environment (`agent.verifiers_env`)."""
    return cfg.pipeline == "agentic" and bool(cfg.agent.verifiers_env) and not cfg.agent.agent_func


def serves_endpoint(cfg: PipelineConfig) -> bool:
    """The run serves the rollout endpoint (written, or turned on by an agent)."""
    return cfg.has_rollout() and (cfg.rollout_endpoint.enabled or uses_agent(cfg))
