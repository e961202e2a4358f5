"""Agents as environments (`agent.agent_func`, docs/endpoint.md): the agentic pipeline's episodes
are a user's `async def agent(client, task) -> float`, written against the `openai` client and
played through the run's rollout endpoint.

`AgentSource` plays rollout_batch_size episodes a step: rollout_batch_size / group_size tasks from
`agent.task_file`, group_size episodes of each at once (`roll_gspo.serving.agents.run_agent`:
timeouts, raises and NaN rewards end an episode with `agent.failure_reward`, counted). Each
episode's record at the endpoint is its trajectory: the exact prompt ids, the ids and log-probs the
rollout engine sampled (mask 1) and what the client sent back between turns (mask 0); the agent's
return value is the reward on its last turn. From there it is the agentic pipeline's own path
(`EpisodeSamples`, held as the environments' source holds it: the samples, and the advantages of
ROLL's reward_normalization, per group with `traj_group_id`), trained by the same trainer loop.
Its episodes are played when a step takes them: an agent's code cannot be paused at a weight sync
nor replayed from a checkpoint, so validation refuses `async_generation_ratio` with it.

`VerifiersSource` is the same source with a verifiers environment as the agent
(`agent.verifiers_env`, `roll_gspo.serving.verifiers_env`): its taskset's tasks, its `Env`'s
episodes played through the endpoint, one sample per trainable trace, the rubric's reward.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Dict, List, Tuple

from roll_gspo.agentic.episodes import trajectory_metrics
from roll_gspo.agentic.health import HealthMonitor
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.plan.run_plan import RunPlan
from roll_gspo.config.plan.endpoint import uses_verifiers
from roll_gspo.envs.agents import agent_function, load_env
from roll_gspo.serving.agents import AgentEpisode, agent_metrics, load_tasks, run_agent

from pipelines.agentic_pipeline import EpisodeSamples, adjust_to_mini_batches
from pipelines.common import timed
from pipelines.setup import RunClusters
from pipelines.sources import RewardFuture, Rollout, RolloutSource
from pipelines.trainer_loop import run_loop

logger = logging.getLogger("roll_gspo")
TAG = "agent"


class AgentSource(RolloutSource):
    """Agentic rollouts whose environment is an agent run through the rollout endpoint, turned into
    samples as the environments' episodes are (`EpisodeSamples`)."""

    def __init__(self, cfg: PipelineConfig, tokenizer):
        from roll_gspo.data.prompts import PromptSampler

        self.cfg = cfg
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.episodes = EpisodeSamples(cfg, self.pad_id, step_wise=False)  # one sample per episode segment
        self.group_size = cfg.train_env_manager.group_size
        tasks = self._load()
        self.sampler = PromptSampler([{"task": task, "index": i} for i, task in enumerate(tasks)],
                                     cfg.rollout_batch_size // self.group_size, seed=cfg.seed,
                                     shuffle=cfg.agent.shuffle)
        self.health = HealthMonitor([])
        self.server = None  # connect()

    def _load(self) -> List:
        """The agent (kept on self) and its tasks."""
        self.agent = agent_function(self.cfg.agent.agent_func)
        return load_tasks(self.cfg.agent.task_file, self.cfg.agent.task_key)

    async def _play(self, tasks: List) -> List[AgentEpisode]:
        """group_size episodes of each task through the endpoint."""
        a = self.cfg.agent
        return await run_agent(self.agent, tasks, self.server, group_size=self.group_size, timeout_s=a.timeout_s,
                               failure_reward=a.failure_reward, max_concurrency=a.max_concurrency or None)

    def _metrics(self, episodes: List[AgentEpisode]) -> Dict[str, float]:
        """Metrics of the source's own (none for an agent function: its return is the reward)."""
        return {}

    def connect(self, clusters: RunClusters) -> None:
        """The run's endpoint (started by the trainer loop: `agent` turns `rollout_endpoint` on)."""
        if clusters.endpoint is None:
            raise RuntimeError("agent.agent_func needs the rollout endpoint, which this run did not start")
        self.server = clusters.endpoint

    # -- rollouts -----------------------------------------------------------------------------------
    def produce(self, step: int, timings: Dict[str, float]) -> Rollout:
        """group_size episodes of each of the step's tasks through the endpoint, as samples."""
        tasks = self.sampler.next_batch()
        with timed(timings, "generate"):
            episodes = asyncio.run(self._play([t["task"] for t in tasks]))
        rows, episode_of = self._rows(episodes, step)
        batch = self.episodes.samples(rows, step)
        batch["episode_id"] = [episode_of[id(t)] for t in rows]
        trainable = bool(batch["loss_mask"].sum())
        if not trainable:
            logger.warning("step %d: no agent episode generated a token (errors: %s); nothing to train on, the step "
                           "is skipped", step, sorted({e.error for e in episodes if e.error})[:3])
        metrics = {**trajectory_metrics(rows, "traj"), **(self.health.metrics() if trainable else {}),
                   **agent_metrics(episodes),
                   "agent/tasks": float(len(tasks)), **self._metrics(episodes)}
        return Rollout(batch, RewardFuture.ready(), metrics, weight_versions=list(batch["weight_version"]),
                       trainable=trainable)

    def _rows(self, episodes: List[AgentEpisode], step: int) -> Tuple[List[Trajectory], Dict[int, str]]:
        """A sample per segment of each episode (one unless the client edited its history); an
        episode that recorded no generated token (its agent failed first) an empty sample in no
        loss and no normalisation set. Made a multiple of the mini-batch when segments add rows."""
        rows: List[Trajectory] = []
        episode_of: Dict[int, str] = {}
        for member, episode in enumerate(episodes):
            group_id = f"{TAG}_{episode.task_index}_{step}"
            trajectories = episode.trajectories or [Trajectory(EpisodeSpec(TAG, 0, group_id, member),
                                                               prompt_ids=[self.pad_id],
                                                               step_rewards=[episode.reward])]
            for t in trajectories:
                t.spec = EpisodeSpec(TAG, 0, group_id, member)
                t.error = episode.error
                t.success = episode.error is None and episode.reward > 0
                if episode.error:
                    t.stop_reason = "env_timeout" if episode.timed_out else "env_error"
                episode_of[id(t)] = episode.episode_id
            rows += trajectories
        if len(rows) != self.cfg.rollout_batch_size:
            rows = adjust_to_mini_batches(rows, self.cfg, step)
        return rows, episode_of

    def advantages(self, batch):
        """The samples' advantages (`EpisodeSamples.advantages`)."""
        return self.episodes.advantages(batch)

    def step_metrics(self, rollout: Rollout, step_seconds: float) -> Dict[str, float]:
        """The agentic metrics and the endpoint's counters (`endpoint/*`, totals of the run)."""
        metrics = self.episodes.step_metrics(rollout, step_seconds)
        metrics.update({f"endpoint/{k}": float(v) for k, v in self.server.metrics().items()})
        return metrics

    # -- validation, checkpoints --------------------------------------------------------------------
    def validate(self, step: int) -> Dict[str, float]:
        """None: validating an agent is refused at load (eval_steps)."""
        return {}

    def state_dict(self) -> Dict[str, object]:
        """The task sampler's position."""
        return {"sampler": self.sampler.state_dict(), "running_stats": None}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Back to the task position a checkpoint saved."""
        if state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])


class VerifiersSource(AgentSource):
    """Agentic rollouts whose agent is a verifiers environment (`agent.verifiers_env`): its
    taskset's tasks, its episodes through the endpoint (X-Session-ID per trace), the rubric's reward."""

    def _load(self) -> List:
        self.env, tasks = load_env(self.cfg.agent.verifiers_env)
        return tasks

    async def _play(self, tasks: List) -> List[AgentEpisode]:
        from roll_gspo.serving.verifiers_env import run_env

        a = self.cfg.agent
        return await run_env(self.env, tasks, self.server, model_name=self.cfg.rollout_endpoint.model_name,
                             group_size=self.group_size, timeout_s=a.timeout_s, failure_reward=a.failure_reward,
                             max_concurrency=a.max_concurrency or None)

    def _metrics(self, episodes: List[AgentEpisode]) -> Dict[str, float]:
        """The rubric's named rewards, each a mean over the step's traces (`verifiers/reward/<name>`)."""
        from roll_gspo.serving.verifiers_env import rubric_metrics

        return rubric_metrics(episodes)


def make_agent_source(cfg: PipelineConfig, tokenizer, plan: RunPlan) -> AgentSource:
    """The source of an agent's episodes (`agent.agent_func`) or a verifiers environment's
    (`agent.verifiers_env`); played when a step takes them, in every plan validation lets through."""
    return (VerifiersSource if uses_verifiers(cfg) else AgentSource)(cfg, tokenizer)


def run_agent_pipeline(cfg: PipelineConfig) -> Dict[str, float]:
    """Train `cfg`'s agentic run on an agent's episodes (`agent.agent_func`) or a verifiers
    environment's (`agent.verifiers_env`) to the end; the last step's metrics."""
    return run_loop(cfg, make_agent_source)
