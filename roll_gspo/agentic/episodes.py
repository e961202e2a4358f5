"""Which episodes a step plays, and what its trajectories measure.

A batch is groups of `group_size` episodes; every episode of a group plays the same env (tag,
config) from the same seed, so the group is the GRPO/GSPO baseline set. Groups are split over the
manager's tags by `num_groups_partition`. Seeds are functions of (seed, step, group, stream): a
resumed run plays the episodes an uninterrupted one does; validation plays the same episodes at
every evaluation, so its curve compares like with like.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

from roll_gspo.agentic.trajectory import STOP_REASONS, EpisodeSpec, Trajectory
from roll_gspo.config.plan.agentic import env_manager_kind
from roll_gspo.schema.config import EnvManagerConfig, PipelineConfig
from roll_gspo.data.prompts import allot
from roll_gspo.lifecycle.seeding import rollout_seeds


def groups_per_tag(manager: EnvManagerConfig, groups: int) -> Dict[str, int]:
    """`groups` split over the manager's tags by num_groups_partition (equal shares when empty)."""
    shares = manager.num_groups_partition or [1] * len(manager.tags)
    return allot(groups, {tag: float(share) for tag, share in zip(manager.tags, shares)})


def episode_specs(manager: EnvManagerConfig, trajectories: int, seed: int, step: int, stream: str) -> List[EpisodeSpec]:
    """`trajectories` episodes (a multiple of group_size), consecutive within a group."""
    size = manager.group_size
    groups = trajectories // size
    seeds = rollout_seeds(seed, step, groups, f"{stream}-env")
    specs, group = [], 0
    for tag, count in groups_per_tag(manager, groups).items():
        for _ in range(count):
            group_id = f"{tag}_{group}_{step}_{seeds[group]}"  # ROLL's traj_group_id: tag, group, episode, seed
            specs += [EpisodeSpec(tag, seeds[group], group_id, group * size + k) for k in range(size)]
            group += 1
    return specs


def turn_seed_fn(seed: int, step: int, count: int, stream: str):
    """(index, turn) -> sampling seed of that turn, a function of the step (exact resume)."""
    bases = turn_seed_bases(seed, step, count, stream)

    def seed_of(index: int, turn: int) -> int:
        return turn_seed(bases[index], turn)

    return seed_of


def turn_seed_bases(seed: int, step: int, count: int, stream: str) -> List[int]:
    """(count,) each episode's seed base: its turn `k` samples with `turn_seed(base, k)`."""
    return [int(base) for base in rollout_seeds(seed, step, count, f"{stream}-turns")]


def turn_seed(base: int, turn: int) -> int:
    """The sampling seed of an episode's `turn` (0-based) from its base."""
    return int((base + 7919 * turn) % (2 ** 31 - 1))


def set_ids(trajectories: List[Trajectory], grouping: str) -> np.ndarray:
    """(N,) the normalisation set of each trajectory: its group, its tag, or one set."""
    if grouping == "batch":
        return np.zeros(len(trajectories), dtype=np.int64)
    keys = [t.spec.group_id if grouping == "traj_group_id" else t.spec.tag for t in trajectories]
    index: Dict[str, int] = {}
    return np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)


def trajectory_metrics(trajectories: List[Trajectory], prefix: str) -> Dict[str, float]:
    """Rewards, success, turns, lengths, stop reasons, env and tool events; overall and per tag
    (`<prefix>/<tag>/...`). prefix: `traj` for training steps, `val` for validation."""
    metrics = _summary(trajectories, prefix)
    tags = sorted({t.spec.tag for t in trajectories})
    if len(tags) > 1:
        for tag in tags:
            metrics.update(_summary([t for t in trajectories if t.spec.tag == tag], f"{prefix}/{tag}"))
    return metrics


def _summary(trajectories: List[Trajectory], prefix: str) -> Dict[str, float]:
    """`<prefix>/...` episode figures; env and tool events as `env/...` and `tool/...` in training
    (`env/<tag>/...` per tag), `val/env/...` and `val/tool/...` in validation."""
    n = max(len(trajectories), 1)
    env = prefix.replace("traj", "env", 1) if prefix.startswith("traj") else f"{prefix}/env"
    tool = prefix.replace("traj", "tool", 1) if prefix.startswith("traj") else f"{prefix}/tool"
    turns = sum(t.turns for t in trajectories)
    rewards = [t.reward for t in trajectories]
    out = {
        f"{prefix}/reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        f"{prefix}/reward_std": float(np.std(rewards)) if rewards else 0.0,
        f"{prefix}/success_rate": sum(t.success for t in trajectories) / n,
        f"{prefix}/num_turns_mean": turns / n,
        f"{prefix}/length_mean": sum(t.length for t in trajectories) / n,
        f"{prefix}/agent_tokens_mean": sum(sum(t.agent_mask) for t in trajectories) / n,
        f"{prefix}/opening_too_long": float(sum(t.opening_too_long for t in trajectories)),
        f"{env}/errors": float(sum(t.stop_reason == "env_error" for t in trajectories)),
        f"{env}/timeouts": float(sum(t.stop_reason == "env_timeout" for t in trajectories)),
        f"{env}/invalid_actions": float(sum(t.invalid_actions for t in trajectories)),
        f"{env}/invalid_action_frac": sum(t.invalid_actions for t in trajectories) / max(turns, 1),
        f"{tool}/calls": float(sum(t.tool_calls for t in trajectories)),
        f"{tool}/call_rate": sum(t.tool_calls for t in trajectories) / max(turns, 1),
        f"{tool}/errors": float(sum(t.tool_errors for t in trajectories)),
    }
    for reason in STOP_REASONS:
        out[f"{prefix}/stop/{reason}"] = float(sum(t.stop_reason == reason for t in trajectories))
    names = sorted({name for t in trajectories for name in t.env_metrics})
    for name in names:
        values = [t.env_metrics[name] for t in trajectories if name in t.env_metrics]
        out[f"{env}/metric/{name}"] = float(np.mean(values))
    return out


def describe_episodes(cfg: PipelineConfig) -> List[str]:
    """--dry-run's lines on what an agentic step plays (groups per tag, turn caps, tools)."""
    lines = []
    kind = env_manager_kind(cfg)
    for name, manager, batch in (("train", cfg.train_env_manager, cfg.rollout_batch_size),
                                 ("validation", cfg.val_env_manager, cfg.val_batch_size)):
        if name == "validation" and not cfg.eval_steps:
            lines.append("episodes (validation): none (eval_steps = 0)")
            continue
        groups = batch // max(manager.group_size, 1)
        split = groups_per_tag(manager, groups) if manager.tags else {}
        if cfg.agent.agent_func:  # an agent through the rollout endpoint: tasks, not custom_envs
            split = {f"agent {cfg.agent.agent_func}, tasks of {cfg.agent.task_file}": groups}
        gen = manager.generating_args
        lines.append(f"episodes ({name}): {batch} = {groups} groups x group_size {manager.group_size} "
                     f"({', '.join(f'{t}: {n}' if cfg.agent.agent_func else f'{t} {n}' for t, n in split.items())}); "
                     f"temperature "
                     f"{gen.temperature:g}" + (f"; {kind}-wise samples" if name == "train" else ""))
    tags = dict.fromkeys(cfg.train_env_manager.tags + (cfg.val_env_manager.tags if cfg.eval_steps else []))
    for tag in tags:
        env = cfg.custom_envs.get(tag)
        if env is None:
            continue
        tools = [str(t.get("tool_id")) for t in (env.tool_wrapper.tool_configs if env.tool_wrapper else [])]
        lines.append(f"  {tag}: {env.env_type}, at most {env.max_steps} turns of <= {env.max_tokens_per_step} "
                     f"tokens, tools: {', '.join(tools) or 'none'}, env step timeout {env.env_step_timeout_s:g} s")
    lines.append(f"  each trajectory within sequence_length = {cfg.sequence_length} tokens")
    return lines
