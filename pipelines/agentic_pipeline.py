"""Agentic pipeline (`pipeline: agentic`): GSPO / GRPO on multi-turn episodes against environments:
the trainer loop (`pipelines.trainer_loop`) fed by episodes.

`EpisodeSource` plays rollout_batch_size episodes a step (groups of group_size from one env seed
each; environments step while the rollout engine generates: each episode's turn is one request to
its rank's engine loop, sent when its env step returns, continuous batching) and turns them into samples (the exact
token ids; observations and tool results masked out of the loss); their rewards are the
environments'. The loop scores the old policy (and the reference for a KL term), takes the source's
advantages (per group of trajectories, or per turn), trains and syncs the weights.

What a source makes of its played trajectories (samples, advantages, step metrics) is
`EpisodeSamples`', which the agent's sources (pipelines.agent_source) hold too.

Asynchronous (docs/async.md), as the run plan says: one step ahead (the loop's rollout buffer) the
next step's episodes play in a driver thread while the trainer trains, joined before the weight
sync (every turn sampled by one version, nothing in flight at a checkpoint). With a staleness
bound k >= 2 `make_episode_source` builds `PooledEpisodeSource`: episodes stay in flight across
steps in an `EpisodePool` (roll_gspo.agentic.episode_pool), cut between turns, each turn stamped
with the version that sampled it, trajectories whose oldest turn would be trained more than k
versions late dropped and counted; a checkpoint saves the held episodes, whose envs a resume replays.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import torch

from roll_gspo.agentic.episode_pool import EpisodePool
from roll_gspo.agentic.episodes import episode_specs, set_ids, trajectory_metrics, turn_seed_bases, turn_seed_fn
from roll_gspo.agentic.health import HealthMonitor
from roll_gspo.agentic.rollout import EnvSetup, EpisodeRunner, SubmitFn, TurnOutput, TurnRequest
from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.agentic.trajectory import (Trajectory, trajectory_tensors, transcript, turn_sample_tensors,
    turn_samples)
from roll_gspo.algorithms.trajectory_advantages import (discounted_turn_returns, step_advantages,
    trajectory_advantages)
from roll_gspo.catalog.estimators import ESTIMATORS
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.plan.agentic import env_manager_kind, error_penalty, manager_generating_args
from roll_gspo.config.plan.run_plan import RunPlan
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.replaceable import ReplaceableCluster
from roll_gspo.lifecycle.seeding import rollout_seeds
from roll_gspo.strategies.engine import Sampling

from pipelines.common import timed
from pipelines.pools import PoolTally, groups_to_add
from pipelines.rollout_records import episode_meta, episode_validation_records
from pipelines.setup import RunClusters
from pipelines.sources import RewardFuture, Rollout, RolloutSource
from pipelines.trainer_loop import run_loop

logger = logging.getLogger("roll_gspo")


def build_env_setups(cfg: PipelineConfig) -> Dict[str, EnvSetup]:
    """Every custom_envs entry an env manager plays, ready to build fresh envs by seed."""
    from roll_gspo.envs.registry import make_env
    from roll_gspo.envs.tools import wrap_with_tools

    tags = dict.fromkeys(cfg.train_env_manager.tags + (cfg.val_env_manager.tags if cfg.eval_steps else []))
    setups = {}
    for tag in tags:
        env_cfg = cfg.custom_envs[tag]

        def make(seed: int, env_cfg=env_cfg):
            kwargs = dict(env_cfg.env_config)
            if "seed" in kwargs:  # ROLL: the group's seed replaces a seed in env_config
                kwargs["seed"] = seed
            env = make_env(env_cfg.env_type, kwargs)
            if env_cfg.tool_wrapper is not None and env_cfg.tool_wrapper.tool_configs:
                env = wrap_with_tools(env, {"wrapper_args": env_cfg.tool_wrapper.wrapper_args,
                                            "tool_configs": env_cfg.tool_wrapper.tool_configs})
            return env

        setups[tag] = EnvSetup(tag, env_cfg, make, error_penalty(env_cfg))
    return setups


class EpisodeSamples:
    """Played trajectories as the trainer's samples, their advantages and a step's metrics: what every
    agentic source (environments' episodes, an agent's, a verifiers environment's) makes of its
    episodes. `step_wise`: a sample per turn (env_manager_cls: step), else one per trajectory."""

    def __init__(self, cfg: PipelineConfig, pad_id: int, step_wise: bool):
        self.cfg, self.pad_id, self.step_wise = cfg, pad_id, step_wise

    def sampleable(self, trajectories: List[Trajectory]) -> List[Trajectory]:
        """Ended trajectories ready to be samples: one whose env failed at reset gets a pad prompt
        (an empty sample, in no loss)."""
        for t in trajectories:
            if not t.prompt_ids:
                t.prompt_ids = [self.pad_id]
        return trajectories

    def samples(self, trajectories: List[Trajectory], step: int) -> Batch:
        """Trainer tensors plus the rows' meta: a sample per trajectory, or per turn (step-wise).
        `turn_returns`: per row, {turn: G_t} of the turns it trains on, so that each turn is one value
        of its normalisation set however many rows share its episode."""
        cfg = self.cfg
        sets = set_ids(trajectories, cfg.reward_normalization.grouping)
        episode_returns = discounted_turn_returns([t.step_rewards for t in trajectories], cfg.step_reward_gamma)
        if not self.step_wise:
            tensors = trajectory_tensors(trajectories, self.pad_id)
            rows = [(t, i) for i, t in enumerate(trajectories)]
            returns = [dict(enumerate(r)) for r in episode_returns]
        else:
            samples = adjust_to_mini_batches(turn_samples(trajectories), cfg, step)
            tensors = turn_sample_tensors(samples, self.pad_id)
            index = {id(t): i for i, t in enumerate(trajectories)}
            rows = [(s.trajectory, index[id(s.trajectory)]) for s in samples]
            returns = [{s.turn: episode_returns[i][s.turn]} for s, (_, i) in zip(samples, rows)]
        batch = Batch(tensors)
        batch["scores"] = torch.tensor([t.reward for t, _ in rows], dtype=torch.float32)
        batch["set_id"] = torch.tensor([int(sets[i]) for _, i in rows], dtype=torch.long)
        batch["turn_returns"] = returns
        batch["started"] = torch.tensor([t.opened for t, _ in rows], dtype=torch.bool)
        # Versions: a trajectory's from its oldest turn, a turn sample's its own; a row without a generated
        # token (its env failed at reset) counts as the newest in the batch (it carries nothing stale).
        newest = max((t.weight_version for t in trajectories if any(t.agent_mask)), default=step - 1)
        token_versions = [t.token_versions() if any(t.agent_mask) else [newest] * len(t.response_ids)
                          for t in trajectories]
        if not self.step_wise:
            batch["token_weight_versions"] = token_versions
        else:
            batch["token_weight_versions"] = [token_versions[i][s.start:s.end] for s, (_, i) in zip(samples, rows)]
        batch["weight_version"] = [min(v, default=newest) for v in batch["token_weight_versions"]]
        batch["finished"] = [t.stop_reason in ("terminated", "truncated", "max_turns") for t, _ in rows]
        batch["episode"] = episode_meta([t for t, _ in rows])  # the rollout files' turns
        return batch

    def advantages(self, batch: Batch):
        """ROLL's agentic chain: normalise in sets (episodes whose env never started in none),
        reward_clip, the token-level KL penalty (add_token_level_kl), whiten, advantage_clip."""
        cfg = self.cfg
        kl = batch["old_log_probs"] - batch["ref_log_probs"] if cfg.add_token_level_kl else None
        common = dict(method=cfg.reward_normalization.method, valid=batch["started"], reward_clip=cfg.reward_clip,
                      kl=kl, kl_coef=cfg.init_kl_coef, whiten_advantages=cfg.whiten_advantages,
                      advantage_clip=cfg.advantage_clip)
        if ESTIMATORS[cfg.adv_estimator].granularity == "turn":  # step_reinforce: each turn its return
            advantages, metrics = step_advantages(batch["turn_returns"], batch["turn_index"], batch["loss_mask"],
                                                  batch["set_id"], batch["scores"], **common)
        else:
            advantages, metrics = trajectory_advantages(batch["scores"], batch["loss_mask"], batch["set_id"], **common)
        metrics["critic/unstarted_samples"] = float((~batch["started"]).sum())
        return advantages, metrics

    def step_metrics(self, rollout: Rollout, step_seconds: float) -> Dict[str, float]:
        """Whether the step was skipped, agent-token throughput (the health counters are the rollout's)."""
        agent_tokens = float(rollout.batch["loss_mask"].sum())
        return {"train/skipped": float(not rollout.trainable),
                "throughput/agent_tokens_per_s": agent_tokens / max(step_seconds, 1e-9),
                "data/samples": float(len(rollout.batch))}


class EpisodeSource(RolloutSource):
    """Agentic rollouts: episodes played against environments, turned into samples
    (`EpisodeSamples`), their rewards the environments' (known when the episodes end); a step's
    episodes played when it takes them, or one step ahead in a driver thread."""

    def __init__(self, cfg: PipelineConfig, tokenizer):
        self.cfg = cfg
        stitcher = ChatStitcher(tokenizer, cfg.actor_train.data_args.template)
        setups = build_env_setups(cfg)
        self.train_gen = manager_generating_args(cfg, cfg.train_env_manager)
        self.val_gen = manager_generating_args(cfg, cfg.val_env_manager)
        self.train_runner = EpisodeRunner(stitcher, setups, sequence_length=cfg.sequence_length,
                                          max_new_tokens=self.train_gen.max_new_tokens,
                                          threads=cfg.train_env_manager.max_env_num_per_worker)
        self.val_runner = EpisodeRunner(stitcher, setups, sequence_length=cfg.sequence_length,
                                        max_new_tokens=self.val_gen.max_new_tokens,
                                        threads=cfg.val_env_manager.max_env_num_per_worker)
        self.episodes = EpisodeSamples(cfg, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                                       step_wise=env_manager_kind(cfg) == "step")
        self.health = HealthMonitor([tag for tag, s in setups.items()
                                     if s.config.tool_wrapper is not None and s.config.tool_wrapper.tool_configs])
        self.actor_infer: Any = None  # connect()
        self.submitter: Callable[[Any, str], SubmitFn] = _not_connected  # connect(): (gen, name) -> turn_submitter
        # The metrics of the rollout generated ahead (a resumed run's first step logs them as the
        # uninterrupted run did).
        self.ahead_metrics: Dict[str, float] = {}

    def connect(self, clusters: RunClusters) -> None:
        """The rollout engine the episodes' turns are generated on: each rank's engine loop
        (continuous batching) from now on, a replaced rank's too (before it takes the weights and
        the turns it held are sent to it again)."""
        self.actor_infer = actor_infer = clusters.actor_infer
        actor_infer.execute_all("start_engine_loop")
        if isinstance(actor_infer, ReplaceableCluster):
            actor_infer.on_replaced.append(lambda rank, worker: ray.get(worker.start_engine_loop.remote()) or "")
        self.submitter = lambda gen, name: turn_submitter(actor_infer, gen, name)

    # -- rollouts -----------------------------------------------------------------------------------
    def produce(self, step: int, timings: Dict[str, float]) -> Rollout:
        """rollout_batch_size episodes as samples (a trajectory each, or a turn each with
        env_manager_cls: step); health warnings; not trainable when no token was generated."""
        with timed(timings, "generate"):
            trajectories = self._play_train(step)
        return self._rollout(trajectories, step, {})

    def start_ahead(self, step: int) -> Tuple[int, Future]:
        """`step`'s episodes started in a driver thread: they play while the trainer trains;
        `finish_ahead` joins them before the weight sync."""
        return step, _in_thread(lambda: self._play_train(step))

    def finish_ahead(self, started: Tuple[int, Future]) -> Rollout:
        """The rollout of the episodes `start_ahead` started, once they are played."""
        step, future = started
        return self._kept_ahead(self._rollout(future.result(), step, {}))

    def _kept_ahead(self, rollout: Rollout) -> Rollout:
        """`rollout`, generated ahead: its metrics kept for the driver state (its trajectories are gone
        once trained; a checkpoint holds its batch)."""
        self.ahead_metrics = dict(rollout.metrics)
        return rollout

    def restore(self, batch: Batch) -> Rollout:
        """The rollout generated ahead again, from the batch a checkpoint saved and the metrics the
        driver state kept of it (its trajectories are gone)."""
        return Rollout(batch, RewardFuture.ready(), dict(self.ahead_metrics),
                       weight_versions=list(batch["weight_version"]), trainable=bool(batch["loss_mask"].sum()))

    def _rollout(self, trajectories: List[Trajectory], step: int, extra: Dict[str, float]) -> Rollout:
        """Played trajectories as `step`'s rollout: samples, health warnings (its counters in the
        metrics, as of this rollout), trajectory metrics."""
        batch = self.episodes.samples(trajectories, step)
        self.health.check(step, trajectories)
        trainable = bool(batch["loss_mask"].sum())
        if not trainable:  # no generated token at all (every opening too long, every reset failed)
            logger.warning("step %d: no trajectory has a generated token (stops: %s); nothing to train on, the "
                           "step is skipped", step, {t.stop_reason for t in trajectories})
        metrics = {**trajectory_metrics(trajectories, "traj"), **(self.health.metrics() if trainable else {}), **extra}
        return Rollout(batch, RewardFuture.ready(), metrics, weight_versions=list(batch["weight_version"]),
                       trainable=trainable)

    def _play_train(self, step: int) -> List[Trajectory]:
        """`step`'s rollout_batch_size training episodes."""
        cfg = self.cfg
        return self._play(cfg.train_env_manager, cfg.rollout_batch_size, step, "train", self.train_gen,
                          self.train_runner)

    def _play(self, manager, count: int, step: int, stream: str, gen, runner: EpisodeRunner) -> List[Trajectory]:
        """`count` episodes of `manager`'s envs, their turns generated by the rollout engine."""
        specs = episode_specs(manager, count, self.cfg.seed, step, stream)
        submit = self.submitter(gen, f"{stream}-{step}")
        return self.episodes.sampleable(runner.run(specs, None, turn_seed_fn(self.cfg.seed, step, len(specs), stream),
                                                   submit=submit))

    # -- advantages, metrics: the samples' ---------------------------------------------------------
    def advantages(self, batch: Batch):
        """The samples' advantages (`EpisodeSamples.advantages`)."""
        return self.episodes.advantages(batch)

    def step_metrics(self, rollout: Rollout, step_seconds: float) -> Dict[str, float]:
        """The samples' step metrics (`EpisodeSamples.step_metrics`)."""
        return self.episodes.step_metrics(rollout, step_seconds)

    # -- validation ---------------------------------------------------------------------------------
    def validate(self, step: int) -> Dict[str, float]:
        """val_batch_size episodes of val_env_manager at its own sampling (greedy by default); the same
        episodes at every evaluation. `val/success_rate`: the fraction solved."""
        cfg = self.cfg
        if not cfg.eval_steps:
            return {}
        start = time.perf_counter()
        trajectories = self._play(cfg.val_env_manager, cfg.val_batch_size, 0, "validation", self.val_gen,
                                  self.val_runner)
        if cfg.render_save_dir:
            os.makedirs(cfg.render_save_dir, exist_ok=True)
            with open(os.path.join(cfg.render_save_dir, f"val_step_{step}.jsonl"), "w") as f:
                for t in trajectories:
                    f.write(json.dumps(transcript(t)) + "\n")
        metrics = trajectory_metrics(trajectories, "val")
        self.validation_records = episode_validation_records(trajectories, step)
        return {**metrics, "val/samples": float(len(trajectories)), "time/validation_s": time.perf_counter() - start}

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The health monitor's counters and the metrics of the rollout generated ahead (its
        trajectories are gone; the checkpoint holds its batch)."""
        return {"sampler": None, "running_stats": None, "health": self.health.state_dict(),
                "episodes_ahead": {"ahead_metrics": dict(self.ahead_metrics)}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Back to the counters and metrics a checkpoint saved (older checkpoints hold none)."""
        if state.get("health"):
            self.health.load_state_dict(state["health"])
        ahead = state.get("episodes_ahead")
        if isinstance(ahead, dict):
            self.ahead_metrics = dict(ahead["ahead_metrics"])


class PooledEpisodeSource(EpisodeSource):
    """Agentic rollouts with a staleness bound k >= 2: episode groups stay in flight across steps in
    an `EpisodePool`, cut between turns; every rollout (the first step's too) is the pool's complete
    groups, their turns sampled by up to k + 1 weight versions."""

    def __init__(self, cfg: PipelineConfig, tokenizer, staleness_bound: int):
        super().__init__(cfg, tokenizer)
        self.pool = EpisodePool(self.train_runner)
        self.staleness_bound = staleness_bound
        self.tally = PoolTally()

    def produce(self, step: int, timings: Dict[str, float]) -> Rollout:
        """The first step's rollout from the episode pool, as every later one."""
        with timed(timings, "generate"):
            return self.finish_ahead(self.start_ahead(step))

    def start_ahead(self, step: int) -> Tuple[int, Future]:
        """The pool's advance for `step` started in a driver thread: new groups for those it no longer
        holds, its quota a rollout batch of groups; `finish_ahead` joins it before the weight sync."""
        cfg, pool, bound = self.cfg, self.pool, self.staleness_bound
        manager = cfg.train_env_manager
        size = manager.group_size
        quota = cfg.rollout_batch_size // size
        new = groups_to_add(cfg.async_pool_batches, quota, len(pool.held))
        specs = episode_specs(manager, new * size, cfg.seed, step, "train")
        bases = turn_seed_bases(cfg.seed, step, len(specs), "train")
        submit = self.submitter(self.train_gen, f"train-{step}")
        return step, _in_thread(lambda: pool.advance(specs, bases, size, quota, step, bound, submit))

    def finish_ahead(self, started: Tuple[int, Future]) -> Rollout:
        """The pool's complete groups once the advance `start_ahead` started is done, with its counts."""
        step, future = started
        groups, counts = future.result()
        metrics = {**self.tally.metrics(counts.partial_groups, counts.as_dict()),
                   "rollout/turns": float(counts.turns), "rollout/rounds": float(counts.rounds)}
        trajectories = self.episodes.sampleable([t for g in groups for t in g.episodes])
        return self._kept_ahead(self._rollout(trajectories, step, metrics))

    def state_dict(self) -> Dict[str, Any]:
        """As the plain source's, and the groups dropped past the bound so far."""
        state = super().state_dict()
        state["episodes_ahead"] = {**state["episodes_ahead"], "dropped_total": self.tally.dropped_total}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Back to where a checkpoint's driver state was."""
        super().load_state_dict(state)
        ahead = state.get("episodes_ahead")
        if isinstance(ahead, dict):
            self.tally.dropped_total = int(ahead.get("dropped_total", 0))

    def pool_states(self) -> Optional[List[Any]]:
        """The episode pool's held groups (what a checkpoint saves)."""
        return [self.pool.state()]

    def load_pool_states(self, states: Optional[List[Any]]) -> None:
        """The held groups a checkpoint saved, their envs replayed, before the first advance."""
        if states:
            self.pool.load_state(states[0])


def make_episode_source(cfg: PipelineConfig, tokenizer, plan: RunPlan) -> EpisodeSource:
    """The agentic source for the plan's rollout mode: episodes in flight under a staleness bound,
    else a step's episodes played for it (when it takes them, or one step ahead: the loop's buffer)."""
    if plan.staleness_bound is not None:
        return PooledEpisodeSource(cfg, tokenizer, plan.staleness_bound)
    return EpisodeSource(cfg, tokenizer)


def _not_connected(gen, name: str) -> SubmitFn:
    raise RuntimeError("EpisodeSource plays episodes once connected to the rollout engine (connect)")


def _in_thread(play: Callable[[], Any]) -> Future:
    """`play()` in a driver thread; its result (or exception) in the returned future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(play())
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish_ahead
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="roll-gspo-episodes-ahead").start()
    return future


def wave_generator(actor_infer, gen):
    """`EpisodeRunner`'s `generate` (waves): the ready episodes' turns as one `generate_turns` call
    split over the rollout ranks. The pipeline submits turns one by one (`turn_submitter`); this is
    the baseline benchmarks/bench_agentic_batching.py measures against."""
    def generate(requests: List[TurnRequest]) -> List[TurnOutput]:
        batch = Batch(meta={"prompt_ids": [r.prompt_ids for r in requests],
                            "max_new_tokens": [r.max_new_tokens for r in requests],
                            "sample_seed": [r.seed for r in requests]})
        out = actor_infer.dispatch("generate_turns", batch, skip_empty=True, gen=gen)
        return [TurnOutput(ids, lps, version) for ids, lps, version in
                zip(out["response_ids"], out["log_probs"], out["weight_version"])]

    return generate


def turn_submitter(actor_infer, gen, name: str):
    """`EpisodeRunner`'s `submit`: an episode's turn as one request to a rollout rank's engine loop
    (`serve_generate`, `actor_infer.submit`), episode i always on rank i mod ranks (its context's
    prefix cached there); the request's seed alone decides its tokens, whichever rank and batch it
    lands in, so a turn sent again to a replaced rank (`ReplaceableCluster.submit`) samples the
    tokens the lost rank would have."""
    run_id, counter = f"turn-{name}-{uuid.uuid4().hex[:8]}", itertools.count()

    def submit(request: TurnRequest) -> "Future[TurnOutput]":
        call = actor_infer.submit(request.index % actor_infer.world_size, "serve_generate",
                                  f"{run_id}-{request.index}-{next(counter)}", request.prompt_ids,
                                  Sampling.of(gen, max_new_tokens=request.max_new_tokens), request.seed)
        turn: Future = Future()

        def done(future: Future) -> None:
            try:
                out = future.result()
                turn.set_result(TurnOutput(list(out.token_ids), list(out.log_probs), out.weight_version))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the episode loop
                turn.set_exception(exc)

        call.add_done_callback(done)
        return turn

    return submit


def adjust_to_mini_batches(samples: list, cfg: PipelineConfig, step: int) -> list:
    """Step-wise samples to a multiple of the mini-batch (batch_adjust_mode), as ROLL: the samples
    copied or dropped are drawn at random (never a fixed position: the tail holds the last group's
    final turns, which carry the terminal reward), from a generator of (seed, step) for exact resume."""
    mini = cfg.mini_batch_size()
    extra = len(samples) % mini
    if not extra:
        return samples
    mode = cfg.batch_adjust_mode
    if mode == "auto":
        mode = "delete" if extra < mini - extra and len(samples) > extra else "copy"
    generator = torch.Generator().manual_seed(rollout_seeds(cfg.seed, step, 1, "batch-adjust")[0])
    if mode == "copy" or len(samples) <= extra:
        missing = mini - extra
        if missing <= len(samples):  # distinct samples while there are enough
            picks = torch.randperm(len(samples), generator=generator)[:missing]
        else:
            picks = torch.randint(len(samples), (missing,), generator=generator)
        return samples + [samples[i] for i in picks.tolist()]
    # delete / random_sample: drop `extra` samples drawn at random (ROLL's random_sample keeps only
    # one mini-batch; here it keeps the most whole mini-batches, as delete does)
    keep = sorted(torch.randperm(len(samples), generator=generator)[:len(samples) - extra].tolist())
    return [samples[i] for i in keep]


def run_agentic(cfg: PipelineConfig) -> Dict[str, float]:
    """Train `cfg`'s agentic run on its environments' episodes to the end; the last step's metrics
    (an agent's or a verifiers environment's episodes: pipelines.agent_source.run_agent_pipeline)."""
    return run_loop(cfg, make_episode_source)
