"""RLVR pipeline (GSPO / GRPO / PPO with verifiable rewards): the trainer loop
(`pipelines.trainer_loop`) fed by prompt groups.

`PromptGroupSource` draws rollout_batch_size prompts a step (in the domain mix), has the rollout
engine sample G responses to each, and scores them with the reward worker of each row's domain
while the loop's log-prob passes run. With dynamic sampling (a reward block's
`query_filter_config`) it scores first and samples again for the prompts whose groups its filter
drops. Its advantages: per group (`adv_estimator`, with ROLL's per-response loss weights) or, for
PPO, GAE over the critic's values.

It generates each rollout with one call over the rollout ranks, when the step takes it
(synchronous) or while the step before trains (one step ahead: the loop's rollout buffer). With a
staleness bound k >= 2 in the run plan (`async_generation_ratio` k) `make_prompt_group_source`
builds `PooledPromptGroupSource` instead, the same prompts and scoring with every rollout from the
rollout ranks' request pools (pipelines.pools, roll_gspo.strategies.request_pool): each call keeps
`async_pool_batches` rollout batches of prompt groups in flight over the ranks, takes the first
complete groups, holds the cut partial responses to continue them under the next weights, and
drops what would be trained more than k versions after its oldest token was sampled (docs/async.md).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from roll_gspo.algorithms import RunningMeanStd, compute_advantages
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.plan.run_plan import RunPlan
from roll_gspo.distributed.batch import Batch
from roll_gspo.lifecycle.seeding import rollout_seeds

from pipelines.common import timed
from pipelines.critic import gae_advantages_and_returns
from pipelines.pools import PoolTally, RequestPools, groups_to_add
from pipelines.reward_scoring import RewardScorer, accuracies, sample_metrics
from pipelines.rollout_records import validation_records
from pipelines.setup import RunClusters, check_domains, load_prompts, reward_routes
from pipelines.sources import RewardFuture, Rollout, RolloutSource, add_sequence_tensors
from pipelines.trainer_loop import run_loop

logger = logging.getLogger("roll_gspo")


class PromptGroupSource(RolloutSource):
    """RLVR's rollouts: G responses to each of rollout_batch_size prompts, rewarded by rule (or model),
    each rollout one generation call (sampled now, or one step ahead)."""

    def __init__(self, cfg: PipelineConfig, tokenizer):
        from roll_gspo.data.prompts import PromptSampler

        self.cfg = cfg
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # Data: every row's domain must route to a reward block before any worker starts.
        self.domain_of_worker = reward_routes(cfg)
        self.train_items, stats = load_prompts(cfg, tokenizer, cfg.actor_train.data_args)
        self.filtered_prompts = stats["filtered_prompts"]
        self.val_items = (load_prompts(cfg, tokenizer, cfg.validation.data_args)[0]
                          if cfg.validation.data_args.file_name or cfg.tasks else [])
        check_domains(self.train_items + self.val_items, self.domain_of_worker)
        self.sampler = PromptSampler(self.train_items, cfg.rollout_batch_size, seed=cfg.seed,
                                     shuffle=cfg.actor_train.data_args.shuffle,
                                     domain_probs=self._mix(),
                                     domain_of=lambda item: self._mix_key(item["domain"]))
        self.query_filters = {name: reward.query_filter_config for name, reward in cfg.rewards.items()
                              if reward.query_filter_config.type != "no_filter"}
        self.running_stats = RunningMeanStd() if cfg.reward_norm == "running" else None
        self.actor_infer: Any = None  # connect()
        self.scorer: Any = None  # connect()

    def connect(self, clusters: RunClusters) -> None:
        """Generation on the rollout engine, scores from the reward clusters."""
        self.actor_infer = clusters.actor_infer
        self.scorer = RewardScorer(clusters.rewards, self.domain_of_worker, self.cfg.fault_tolerance)

    def _mix(self) -> Dict[str, float]:
        """The training mix (domain -> share): each task's weight with `tasks`, else ROLL's
        domain_interleave_probs over reward blocks."""
        tasks = self.cfg.tasks
        return {k: t.weight for k, t in tasks.items()} if tasks else self.cfg.actor_train.data_args.domain_interleave_probs

    def _mix_key(self, domain: str) -> str:
        """What a row's domain counts as in the mix: the task (with `tasks`), else its reward block."""
        return domain if self.cfg.tasks else self.domain_of_worker[domain]

    # -- rollouts -----------------------------------------------------------------------------------
    def produce(self, step: int, timings: Dict[str, float]) -> Rollout:
        """G responses per prompt (dynamic sampling: scored already, and only informative groups)."""
        if self.query_filters:
            batch, metrics = self._generate_informative_groups(self.sampler.next_batch(), step, timings)
            return self._rollout(batch, RewardFuture.ready(lambda: self.scorer.metrics(batch)), metrics)
        with timed(timings, "generate"):
            batch = self._generate(self.sampler.next_batch(), step, "train")
        return self.restore(batch)

    def start_ahead(self, step: int) -> list:
        """`step`'s prompts drawn and their generation started: the calls, for `finish_ahead`."""
        return self.actor_infer.dispatch_async("generate", self._prompt_batch(self.sampler.next_batch(), step, "train"),
                                               skip_empty=True, gen=self.cfg.actor_infer.generating_args)

    def finish_ahead(self, started: list) -> Rollout:
        """The rollout of the calls `start_ahead` returned, once they are done."""
        return self.restore(self.actor_infer.collect(started))

    def restore(self, batch: Batch) -> Rollout:
        """A rollout of generated responses, their rewards to be scored."""
        return self._generated(batch, {})

    def _generated(self, batch: Batch, metrics: Dict[str, float]) -> Rollout:
        """The rollout of generated responses with the source's `metrics`, its rewards scored while the
        loop's log-prob passes run (or, scored already by dynamic sampling, their metrics)."""
        rewards = (RewardFuture.ready(lambda: self.scorer.metrics(batch)) if "scores" in batch
                   else self.scorer.future(batch))
        return self._rollout(batch, rewards, metrics)

    def _rollout(self, batch: Batch, rewards: RewardFuture, metrics: Dict[str, float]) -> Rollout:
        """The rollout of a generated batch, with the trainer's tensors added."""
        add_sequence_tensors(batch, self.pad_id)
        return Rollout(batch, rewards, metrics, weight_versions=list(batch["weight_version"]))

    def _prompt_batch(self, items: List[dict], step: int, stream: str) -> Batch:
        """Prompts with their rollout seeds (`sample_seed`: a function of seed, step and position,
        so a resumed run samples what an uninterrupted one does)."""
        keys = ("prompt_ids", "prompt_text", "ground_truth", "domain") + (
            ("difficulty",) if items and "difficulty" in items[0] else ())
        meta = {k: [item[k] for item in items] for k in keys}
        meta["sample_seed"] = rollout_seeds(self.cfg.seed, step, len(items), stream)
        return Batch(meta=meta)

    def _generate(self, items: List[dict], step: int, stream: str) -> Batch:
        """G responses per prompt, consecutive rows per prompt."""
        return self.actor_infer.dispatch("generate", self._prompt_batch(items, step, stream), skip_empty=True,
                                         gen=self.cfg.actor_infer.generating_args)

    def _generate_informative_groups(self, prompts: List[dict], step: int, timings: Dict[str, float]):
        """Dynamic sampling (ROLL's query_filter_config), synchronous: generate, then
        `_informative_groups` with further generations of their own seeds (exact resume)."""
        def generate(items: List[dict], rounds: int) -> Batch:
            with timed(timings, "generate"):
                return self._generate(items, step, "train" if rounds == 1 else f"train-round{rounds}")

        return self._informative_groups(generate(prompts, 1), generate, timings)

    def _informative_groups(self, batch: Batch, regenerate: Callable[[List[dict], int], Batch],
                            timings: Optional[Dict[str, float]] = None):
        """Score the groups of `batch`, drop those their domain's filter rejects, and sample
        (`regenerate(prompts, round)`) as many new prompts of the dropped groups' domains until
        rollout_batch_size groups are kept or query_filter_max_rounds rounds were made; then top up
        with dropped groups. Returns the scored batch and `data/*` metrics."""
        cfg, group = self.cfg, self.cfg.num_return_sequences_in_group
        kept, dropped = [], []
        rounds = extra_prompts = 0
        while True:
            rounds += 1
            with timed(timings, "reward") if timings is not None else contextlib.nullcontext():
                self.scorer.score(batch)
            refill: Dict[str, int] = {}
            for index, keep in enumerate(self._groups_to_keep(batch)):
                rows = batch.select(range(index * group, (index + 1) * group))
                (kept if keep else dropped).append(rows)
                if not keep:
                    domain = self._mix_key(rows["domain"][0])
                    refill[domain] = refill.get(domain, 0) + 1
            missing = cfg.rollout_batch_size - len(kept)
            if missing <= 0 or rounds >= cfg.query_filter_max_rounds:
                break
            prompts = self.sampler.next_batch(per_domain=_scale_counts(refill, missing))
            extra_prompts += len(prompts)
            batch = regenerate(prompts, rounds + 1)
        filtered = len(dropped)
        cap_hit = len(kept) < cfg.rollout_batch_size
        groups = (kept + dropped)[:cfg.rollout_batch_size]  # topped up with dropped groups at the cap
        return Batch.concat(groups), {
            "data/filtered_groups": float(filtered), "data/extra_prompts": float(extra_prompts),
            "data/sampling_rounds": float(rounds), "data/filter_cap_hit": float(cap_hit),
            "data/kept_group_frac": float(min(len(kept), cfg.rollout_batch_size)) / cfg.rollout_batch_size}

    def _groups_to_keep(self, batch: Batch) -> List[bool]:
        """Per prompt group: does its reward domain's query filter keep it?"""
        from roll_gspo.algorithms.query_filter import keep_groups

        group = self.cfg.num_return_sequences_in_group
        domains = [self.domain_of_worker[d] for d in batch["domain"][::group]]
        keep = [True] * len(domains)
        for name, qf in self.query_filters.items():
            rows = [i for i, d in enumerate(domains) if d == name]
            if rows:
                scores = batch["scores"].view(-1, group)[rows].reshape(-1)
                for i, k in zip(rows, keep_groups(scores, group, qf.type, qf.filter_args).tolist()):
                    keep[i] = k
        return keep

    # -- advantages ---------------------------------------------------------------------------------
    def advantages(self, batch: Batch):
        """(B, T) advantages: per group (`adv_estimator`, optional KL penalty; gdpo: from the reward
        workers' named components, `gdpo_reward_keys`) or, PPO (gae), GAE over the critic's `values`
        (adds `returns` too); use_opd: plus the teacher's dense per-token term (is_pure_opd: that term
        alone); then ROLL's per-response loss weights."""
        cfg = self.cfg
        if cfg.uses_critic():
            metrics = gae_advantages_and_returns(cfg, batch, self.running_stats)
        else:
            from roll_gspo.algorithms.advantages import reward_component_matrix
            from roll_gspo.catalog.estimators import ESTIMATORS

            components = None
            if ESTIMATORS[cfg.adv_estimator].components:
                components = reward_component_matrix(
                    batch["reward_metrics"] if "reward_metrics" in batch else [None] * len(batch),
                    cfg.gdpo_reward_keys, statuses=batch["reward_status"], domains=batch["domain"])
            kl = batch["old_log_probs"] - batch["ref_log_probs"] if cfg.add_token_level_kl else None
            batch["advantages"], metrics = compute_advantages(
                batch["scores"], batch["response_mask"], group_size=cfg.num_return_sequences_in_group,
                adv_estimator=cfg.adv_estimator, reward_norm=cfg.reward_norm, reward_shift=cfg.reward_shift,
                reward_scale=cfg.reward_scale, reward_clip=cfg.reward_clip, running_stats=self.running_stats,
                kl=kl, kl_coef=cfg.init_kl_coef if kl is not None else 0.0,
                whiten_advantages=cfg.whiten_advantages, advantage_clip=cfg.advantage_clip,
                reward_components=components, component_weights=cfg.gdpo_reward_weights)
            if components is not None:
                metrics.update({f"critic/gdpo/{key}_mean": float(components[:, k].mean())
                                for k, key in enumerate(cfg.gdpo_reward_keys)})
        if cfg.uses_teacher():  # on-policy distillation: the dense per-token reverse KL to the teacher
            from roll_gspo.algorithms.distillation import opd_advantages

            # is_pure_opd (ROLL's pure mode): the teacher term alone; the task reward is logged, not trained on
            task = torch.zeros_like(batch["advantages"]) if cfg.is_pure_opd else batch["advantages"]
            batch["advantages"], opd_metrics = opd_advantages(
                task, batch["old_log_probs"], batch["teacher_log_probs"], batch["response_mask"],
                batch["teacher_kl_coef"])  # per row: each teacher's opd_kl_coef, summed over those that scored it
            metrics.update(opd_metrics)
        metrics.update(self._apply_sample_weights(batch))
        return batch["advantages"], metrics

    def _apply_sample_weights(self, batch: Batch) -> Dict[str, float]:
        """ROLL's per-response masks and loss weights: a weight w > 0 scales the response's
        advantages (the clipped surrogate is linear in A for a positive factor, so this is w times
        its loss); w = 0 leaves it out of the loss via `loss_mask`. Nothing when all are off."""
        cfg = self.cfg
        if not (cfg.max_len_mask or cfg.difficulty_mask or cfg.error_max_len_clip or cfg.difficulty_loss_weight
                or cfg.length_loss_weight):
            return {}
        from roll_gspo.algorithms.sample_weights import sample_loss_weights

        lengths = batch["response_mask"].sum(-1)
        truncated = torch.tensor([not f for f in batch["finished"]], dtype=torch.bool)
        difficulty = (torch.tensor([float(d) for d in batch["difficulty"]]) if cfg.difficulty_loss_weight
                      else None)
        weights, metrics = sample_loss_weights(
            batch["scores"], lengths, truncated, cfg.num_return_sequences_in_group,
            max_len_mask=cfg.max_len_mask, difficulty_mask=cfg.difficulty_mask,
            difficulty_low=cfg.difficulty_low_threshold, difficulty_high=cfg.difficulty_high_threshold,
            error_max_len_clip=cfg.error_max_len_clip, error_max_len_threshold=cfg.error_max_len_threshold,
            difficulty=difficulty, length_loss_weight=cfg.length_loss_weight)
        batch["advantages"] = batch["advantages"] * weights[:, None]
        batch["loss_mask"] = batch["response_mask"] * (weights > 0).float()[:, None]
        return metrics

    # -- metrics, validation, checkpoints -------------------------------------------------------------
    def step_metrics(self, rollout: Rollout, step_seconds: float) -> Dict[str, float]:
        """Response lengths, throughput and the data position."""
        batch = rollout.batch
        lengths = batch["response_mask"].sum(-1)
        return {"response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
                "response/truncated_frac": 1.0 - sum(batch["finished"]) / len(batch),
                "throughput/tokens_per_s": float(lengths.sum()) / max(step_seconds, 1e-9),
                "data/epoch": float(self.sampler.epoch), "data/filtered_prompts": float(self.filtered_prompts)}

    def validate(self, step: int) -> Dict[str, float]:
        """The validation prompts at validation.generating_args, scored: rewards, accuracy, pass@k, maj@k."""
        if not self.val_items:
            return {}
        start = time.perf_counter()
        prompts = self._prompt_batch(self.val_items, step, "validation")
        batch = self.actor_infer.dispatch("generate", prompts, gen=self.cfg.validation.generating_args)
        self.scorer.score(batch)
        metrics = self.scorer.metrics(batch, prefix="val")
        metrics = {k.replace("/mean", "/reward_mean") if k.endswith("/mean") else k: v for k, v in metrics.items()
                   if not k.endswith("/std")}
        metrics.update(accuracies(batch["domain"], batch["reward_correct"]))
        metrics.update(sample_metrics(batch, self.cfg.validation.generating_args.num_return_sequences))
        self.validation_records = validation_records(batch, step)
        return {**metrics, "val/samples": float(len(batch)), "time/validation_s": time.perf_counter() - start}

    def state_dict(self) -> Dict[str, object]:
        """The prompt sampler's position and the running reward statistics."""
        return {"sampler": self.sampler.state_dict(),
                "running_stats": self.running_stats.state_dict() if self.running_stats else None}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Back to the sampler position and reward statistics a checkpoint saved."""
        self.sampler.load_state_dict(state["sampler"])
        if self.running_stats is not None and state.get("running_stats"):
            self.running_stats.load_state_dict(state["running_stats"])


class PooledPromptGroupSource(PromptGroupSource):
    """RLVR's rollouts with a staleness bound k >= 2: the same prompts, scoring and advantages, every
    rollout (the first step's too) the complete groups of the rollout ranks' request pools
    (`RequestPools`), responses spanning up to k weight versions."""

    def __init__(self, cfg: PipelineConfig, tokenizer, staleness_bound: int):
        super().__init__(cfg, tokenizer)
        self.pools = RequestPools(staleness_bound, cfg.actor_infer.generating_args)
        self.tally = PoolTally()
        # The metrics of the rollout generated ahead (a resumed run's first step logs them as the
        # uninterrupted run did).
        self.ahead_metrics: Dict[str, float] = {}

    def connect(self, clusters: RunClusters) -> None:
        """As the plain source; the rollout ranks' pools advance from now on."""
        super().connect(clusters)
        self.pools.connect(clusters.actor_infer)

    def produce(self, step: int, timings: Dict[str, float]) -> Rollout:
        """The first step's rollout from the request pools, as every later one."""
        with timed(timings, "generate"):
            return self.finish_ahead(self.start_ahead(step))

    def start_ahead(self, step: int) -> list:
        """Each rollout rank's pool advanced for `step`: new prompts for the groups it no longer
        holds (taken or dropped; all of them at the first call), its quota its share of
        rollout_batch_size. Each rank's pool is async_pool_batches of its own quota: split apart,
        an uneven split could give a rank more than k quotas, which the staleness bound then drops."""
        quotas = self.pools.shares(self.cfg.rollout_batch_size)
        new = [groups_to_add(self.cfg.async_pool_batches, quota, held) for quota, held in zip(quotas, self.pools.held)]
        items = self.sampler.next_batch(size=sum(new)) if sum(new) else []
        return self.pools.advance(step, self._prompt_batch(items, step, "train"), new, quotas, range(len(new)))

    def _refill(self, items: List[dict], rounds: int, counts: Dict[str, int]) -> Batch:
        """Dynamic sampling's further round `rounds` (same weights, same step): `items` as new
        prompts, each rank returning as many complete groups as it takes; ranks with none idle."""
        step, quotas = self.pools.step, self.pools.shares(len(items))
        calls = self.pools.advance(step, self._prompt_batch(items, step, f"train-round{rounds}"), quotas, quotas,
                                   [rank for rank, quota in enumerate(quotas) if quota])
        return self.pools.collect(calls, counts)

    def finish_ahead(self, started: list) -> Rollout:
        """The pools' complete groups (dynamic sampling: scored, filtered and refilled while the reward
        workers are idle, under the same weights), with the advance's `rollout/*` counts."""
        counts: Dict[str, int] = {}
        batch = self.pools.collect(started, counts)
        data_metrics: Dict[str, float] = {}
        if self.query_filters:
            batch, data_metrics = self._informative_groups(
                batch, lambda items, rounds: self._refill(items, rounds, counts))
        self.ahead_metrics = {**self.tally.metrics(sum(self.pools.held), counts), **data_metrics}
        return self.restore(batch)

    def restore(self, batch: Batch) -> Rollout:
        """A rollout of the pools' groups (scored already with dynamic sampling), with the metrics of
        the advance that returned it."""
        return self._generated(batch, dict(self.ahead_metrics))

    def pool_states(self) -> Optional[List[Any]]:
        """Every rollout rank's held groups (what a checkpoint saves)."""
        return self.pools.states()

    def load_pool_states(self, states: Optional[List[Any]]) -> None:
        """The rollout ranks' held groups a checkpoint saved, before the first advance."""
        if states is not None:
            self.pools.load_states(states)

    def state_dict(self) -> Dict[str, object]:
        """As the plain source's, and the drops so far and the metrics of the rollout generated ahead."""
        return {**super().state_dict(), "request_pools": {"dropped_total": self.tally.dropped_total,
                                                          "ahead_metrics": self.ahead_metrics}}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Back to where a checkpoint's driver state was."""
        super().load_state_dict(state)
        pools = state.get("request_pools")
        if isinstance(pools, dict):
            self.tally.dropped_total = int(pools["dropped_total"])
            self.ahead_metrics = dict(pools["ahead_metrics"])


def make_prompt_group_source(cfg: PipelineConfig, tokenizer, plan: RunPlan) -> PromptGroupSource:
    """RLVR's source for the plan's rollout mode: request pools under a staleness bound, else one
    generation call per rollout (synchronous or one step ahead: the loop's buffer decides)."""
    if plan.staleness_bound is not None:
        return PooledPromptGroupSource(cfg, tokenizer, plan.staleness_bound)
    return PromptGroupSource(cfg, tokenizer)


def _scale_counts(counts: Dict[str, int], total: int) -> Dict[str, int]:
    """`counts` (domain -> dropped groups) rescaled to sum to `total`, in proportion."""
    from roll_gspo.data.prompts import allot

    return allot(total, counts) if sum(counts.values()) != total else counts


def run_rlvr(cfg: PipelineConfig) -> Dict[str, float]:
    """Train `cfg`'s RLVR run to the end; the last step's metrics. A `warm_start` block runs (or a
    finished one is reused) first, and RL continues from its model (pipelines.rft_warm_start)."""
    from pipelines.rft_warm_start import warm_start

    return run_loop(warm_start(cfg), make_prompt_group_source)
