"""verifiers environments as agents (issue 38 item 5; `agent.verifiers_env`, docs/endpoint.md).

A verifiers 0.4 (`verifiers.v1`) environment plays its episodes unchanged: its agents' harnesses
call the model through verifiers' interception server, whose client (`EvalClientConfig`) forwards
each request to this run's endpoint with the rollout's trace id as `X-Session-ID` on every turn.
The endpoint keys episodes by that header (`roll_gspo.serving.server.SESSION_HEADER`), so each
trace's requests land in one record; the trace's rubric reward (`Trace.reward`: the task's
`@reward`s and judges, weighted) is that record's reward. Each trainable trace is one
`AgentEpisode`, as an agent function's episode is (`roll_gspo.serving.agents`); traces of agents
the env marks untrainable (a simulated user, a judge) are dropped, their records discarded.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence

from roll_gspo.envs.agents import INSTALL, env_config, load_env
from roll_gspo.serving.agents import AgentEpisode
from roll_gspo.serving.server import RolloutServer

logger = logging.getLogger("roll_gspo.serving")
TOKEN_VAR = "ROLL_GSPO_ENDPOINT_TOKEN"  # verifiers' client reads its api key from an environment variable


async def run_env(env, tasks: Sequence[Any], server: RolloutServer, *, model_name: str, group_size: int = 1,
                  timeout_s: float = 300.0, failure_reward: float = 0.0,
                  max_concurrency: Optional[int] = None) -> List[AgentEpisode]:
    """`group_size` episodes of each verifiers task through `server`, in task order: one
    `AgentEpisode` per trainable trace, its reward the trace's rubric reward. An episode that
    errs or runs past `timeout_s` gives its traces `failure_reward` (counted as errors/timeouts)."""
    from verifiers.v1 import EvalClientConfig
    from verifiers.v1.clients import ModelContext

    if server.token:
        os.environ[TOKEN_VAR] = server.token
    client = EvalClientConfig(base_url=server.address, api_key_var=TOKEN_VAR)
    ctx = ModelContext(model=model_name, client=client)
    gate = asyncio.Semaphore(max_concurrency or len(tasks) * group_size or 1)
    async with env.serving():
        planned = [(i, slot) for i, task in enumerate(tasks) for slot in env.slots(task, group_size)]
        played = await asyncio.gather(*(_play(env, slot, ctx, server, i, timeout_s, failure_reward, gate)
                                        for i, slot in planned))
    return [episode for episodes in played for episode in episodes]


async def _play(env, slot, ctx, server: RolloutServer, task_index: int, timeout_s: float, failure_reward: float,
                gate: asyncio.Semaphore) -> List[AgentEpisode]:
    error, timed_out, episode = None, False, None
    start = time.perf_counter()
    async with gate:
        try:
            episode = await asyncio.wait_for(env.run_slot(slot, ctx), timeout_s)
            if episode.errors:
                error = "; ".join(f"{e.type}: {e.message}" for e in episode.errors)[:500]
                timed_out = bool(episode.is_timeout)
        except asyncio.TimeoutError:
            error, timed_out = f"verifiers episode ran past {timeout_s} s", True
        except Exception as exc:  # noqa: BLE001  (an episode's failure is counted, the step goes on)
            error = f"{type(exc).__name__}: {exc}"
    await asyncio.sleep(0)  # let the endpoint see a cancelled request go
    traces = list(episode.traces) if episode is not None else list(slot.traces)
    seconds = time.perf_counter() - start
    out = []
    for member, trace in enumerate(traces):
        record = server.take_episode(trace.id)
        if not trace.agent.trainable:
            continue
        trace_error = error or (None if trace.ok else _trace_error(trace))
        reward = failure_reward if trace_error else float(trace.reward)
        if reward != reward:  # NaN
            reward, trace_error = failure_reward, "the rubric's reward is NaN"
        trajectories = record.trajectories(reward, group_id=f"task{task_index}", index=member) if record else []
        signals = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
        out.append(AgentEpisode(task_index, trace.id, reward, trajectories, trace_error,
                                bool(trace_error) and (timed_out or bool(trace.is_timeout)), seconds,
                                record.mismatches if record else 0, signals))
    if error:
        logger.warning("verifiers episode of task %d failed: %s", task_index, error)
        if not out:  # nothing recorded (the env failed before any trace): one counted empty episode
            out.append(AgentEpisode(task_index, f"task{task_index}-failed", failure_reward, [], error, timed_out,
                                    seconds))
    return out


def rubric_metrics(episodes: List[AgentEpisode]) -> Dict[str, float]:
    """The mean of each named rubric reward over the traces that have it: `verifiers/reward/<name>`."""
    sums: Dict[str, List[float]] = {}
    for e in episodes:
        for name, value in e.signals.items():
            sums.setdefault(name, []).append(value)
    return {f"verifiers/reward/{name}": sum(v) / len(v) for name, v in sorted(sums.items())}


def _trace_error(trace) -> str:
    last = trace.last_error
    return f"{last.type}: {last.message}"[:500] if last is not None else "the trace is not ok (verifiers)"


__all__ = ["env_config", "load_env", "run_env", "rubric_metrics", "INSTALL"]
