"""Agents as environments (issue 38 item 4): a user's `async def agent(client, task) -> float`,
written against the `openai` client, played N episodes at once against the rollout endpoint.

Each episode gets a client bound to its own episode id (the `X-Episode-Id` header on every
request), so whatever the agent does (several turns, tool loops, sub-calls) lands in one record;
its return value is the episode's reward. `group_size` episodes per task make the GRPO/GSPO group
(their trajectories share a `group_id`). An agent that raises or runs past `timeout_s` ends its
episode with `failure_reward`, counted; its requests still in flight are cancelled (the endpoint
aborts them on the rank). The run goes on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence

from roll_gspo.agentic.trajectory import Trajectory
from roll_gspo.envs.agents import load_tasks  # noqa: F401  (the runner's tasks; imported from here too)
from roll_gspo.serving.episodes import EpisodeStore
from roll_gspo.serving.server import EPISODE_HEADER, RolloutServer

logger = logging.getLogger("roll_gspo.serving")
Agent = Callable[[Any, Any], Awaitable[float]]


@dataclasses.dataclass
class AgentEpisode:
    task_index: int
    episode_id: str
    reward: float
    trajectories: List[Trajectory]
    error: Optional[str] = None
    timed_out: bool = False
    seconds: float = 0.0
    mismatches: int = 0
    signals: Dict[str, float] = dataclasses.field(default_factory=dict)  # named reward parts (verifiers' rubric)


async def _play(agent: Agent, base_client, server: RolloutServer, task: Any, task_index: int, member: int,
                timeout_s: float, failure_reward: float, gate: asyncio.Semaphore) -> AgentEpisode:
    episode_id = EpisodeStore.new_id()
    client = base_client.with_options(default_headers={EPISODE_HEADER: episode_id})
    error, timed_out = None, False
    start = time.perf_counter()
    async with gate:
        try:
            reward = float(await asyncio.wait_for(agent(client, task), timeout_s))
            if reward != reward:  # NaN
                raise ValueError("the agent returned NaN")
        except asyncio.TimeoutError:
            reward, error, timed_out = failure_reward, f"agent ran past {timeout_s} s", True
        except Exception as exc:
            reward, error = failure_reward, f"{type(exc).__name__}: {exc}"
    if error:
        logger.warning("agent episode %s (task %d) failed: %s", episode_id, task_index, error)
    await asyncio.sleep(0)  # let the endpoint see a cancelled request go
    record = server.take_episode(episode_id)
    trajectories = record.trajectories(reward, group_id=f"task{task_index}", index=member) if record else []
    return AgentEpisode(task_index, episode_id, reward, trajectories, error, timed_out,
                        time.perf_counter() - start, record.mismatches if record else 0)


async def run_agent(agent: Agent, tasks: Sequence[Any], server: RolloutServer, *, group_size: int = 1,
                    timeout_s: float = 300.0, failure_reward: float = 0.0,
                    max_concurrency: Optional[int] = None) -> List[AgentEpisode]:
    """`group_size` episodes of each task, all at once (at most `max_concurrency`), in task order."""
    import openai

    base = openai.AsyncOpenAI(base_url=server.address, api_key=server.token or "roll-gspo", max_retries=0,
                              timeout=timeout_s)
    gate = asyncio.Semaphore(max_concurrency or len(tasks) * group_size or 1)
    try:
        return list(await asyncio.gather(*(
            _play(agent, base, server, task, i, j, timeout_s, failure_reward, gate)
            for i, task in enumerate(tasks) for j in range(group_size))))
    finally:
        await base.close()


def agent_metrics(episodes: List[AgentEpisode]) -> Dict[str, float]:
    n = max(len(episodes), 1)
    return {"agent/episodes": float(len(episodes)),
            "agent/reward_mean": sum(e.reward for e in episodes) / n,
            "agent/errors": float(sum(e.error is not None and not e.timed_out for e in episodes)),
            "agent/timeouts": float(sum(e.timed_out for e in episodes)),
            "agent/history_mismatches": float(sum(e.mismatches for e in episodes)),
            "agent/samples": float(sum(len(e.trajectories) for e in episodes))}
