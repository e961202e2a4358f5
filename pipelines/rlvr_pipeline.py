"""RLVR pipeline (GSPO / GRPO / PPO with verifiable rewards): the trainer loop
(`pipelines.trainer_loop`) fed by prompt groups.

`PromptGroupSource` draws rollout_batch_size prompts a step (in the domain mix), has the rollout
engine sample G responses to each, and scores them with the reward worker of each row's domain
while the loop's log-prob passes run. With dynamic sampling (a reward block's
`query_filter_config`) it scores first and samples again for the prompts whose groups its filter
drops. Its advantages: per group (`adv_estimator`, with ROLL's per-response loss weights) or, for
PPO, GAE over the critic's values.

With `async_generation_ratio` k >= 2 every rollout comes from the rollout ranks' request pools
(roll_gspo.strategies.request_pool): each call keeps `async_pool_batches` rollout batches of prompt
groups in flight over the ranks, takes the first complete groups, holds the cut partial responses
to continue them under the next weights, and drops what would be trained more than k versions
after its oldest token was sampled (docs/async.md).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional

import ray
import torch

from roll_gspo.algorithms import RunningMeanStd, compute_advantages
from roll_gspo.config import PipelineConfig
from roll_gspo.config.plan.async_mode import staleness_bound
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.replaceable import ReplaceableCluster
from roll_gspo.lifecycle.seeding import rollout_seeds

from pipelines.common import timed
from pipelines.critic import gae_advantages_and_returns
from pipelines.reward_scoring import RewardScorer, accuracies, sample_metrics
from pipelines.rollout_records import validation_records
from pipelines.setup import RunClusters, check_domains, load_prompts, reward_routes
from pipelines.sources import RewardFuture, Rollout, RolloutSource, add_sequence_tensors
from pipelines.trainer_loop import run_loop

logger = logging.getLogger("roll_gspo")


class PromptGroupSource(RolloutSource):
    """RLVR's rollouts: G responses to each of rollout_batch_size prompts, rewarded by rule (or model)."""

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
        self.actor_infer = self.scorer = None  # connect()
        # async_generation_ratio k >= 2: the request pools' bound, the groups each rank held after its
        # last advance, the drops so far, and the metrics of the rollout generated ahead (a resumed
        # run's first step logs them as the uninterrupted run did).
        self.bound = staleness_bound(cfg)
        self.pool_held: List[int] = []
        self.dropped_total = 0
        self.ahead_metrics: Dict[str, float] = {}
        self.ahead_step = 0  # the step of the last pool advance, and the ranks it advanced
        self.pool_ranks: List[int] = []
        # Replaceable rollout ranks: each rank's pool as its last advance left it, for a new process
        # that replaces it (the call it then gets again continues the same groups).
        self.pool_copies: Optional[Dict[int, Any]] = None

    def connect(self, clusters: RunClusters) -> None:
        """Generation on the rollout engine, scores from the reward clusters."""
        self.actor_infer = clusters.actor_infer
        self.scorer = RewardScorer(clusters.rewards, self.domain_of_worker, self.cfg.fault_tolerance)
        if self.bound is not None and isinstance(self.actor_infer, ReplaceableCluster):
            self.pool_copies = {}
            self.actor_infer.on_replaced.append(self._give_pool)

    def _give_pool(self, rank: int, worker) -> str:
        """A replaced rollout rank's hook (k >= 2): the groups its pool held after its last advance."""
        state = self.pool_copies.get(rank) if self.pool_copies is not None else None
        ray.get(worker.load_pool_state.remote(state))
        return f"its request pool's {len(state['held'])} held groups given back" if state else ""

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
        """G responses per prompt (dynamic sampling: scored already, and only informative groups).
        k >= 2: the first step's rollout from the request pools, as every later one."""
        if self.bound is not None:
            with timed(timings, "generate"):
                return self.finish_ahead(self.start_ahead(step))
        if self.query_filters:
            batch, metrics = self._generate_informative_groups(self.sampler.next_batch(), step, timings)
            return self._rollout(batch, RewardFuture.ready(lambda: self.scorer.metrics(batch)), metrics)
        with timed(timings, "generate"):
            batch = self._generate(self.sampler.next_batch(), step, "train")
        return self.restore(batch)

    def start_ahead(self, step: int) -> list:
        """`step`'s prompts drawn and their generation started: the calls, for `finish_ahead`."""
        if self.bound is not None:
            return self._advance_pools(step)
        return self.actor_infer.dispatch_async("generate", self._prompt_batch(self.sampler.next_batch(), step, "train"),
                                               skip_empty=True, gen=self.cfg.actor_infer.generating_args)

    def finish_ahead(self, started: list) -> Rollout:
        """The rollout of the calls `start_ahead` returned, once they are done."""
        if self.bound is not None:
            counts: Dict[str, int] = {}
            batch = self._collect_pools(started, counts)
            data_metrics: Dict[str, float] = {}
            if self.query_filters:  # the reward workers are idle now: score, refill under the same weights
                step = self.ahead_step
                batch, data_metrics = self._informative_groups(batch, lambda items, rounds: self._collect_pools(
                    self._advance_pools(step, items, f"train-round{rounds}"), counts))
            self.dropped_total += counts["dropped_past_bound"]
            self.ahead_metrics = {
                "rollout/partial_groups": float(sum(self.pool_held)),
                "rollout/dropped_past_bound": float(counts["dropped_past_bound"]),
                "rollout/dropped_past_bound_total": float(self.dropped_total),
                "rollout/continuations": float(counts["continuations"]),
                "rollout/reprefill_tokens": float(counts["reprefill_tokens"]),
                "rollout/new_groups": float(counts["new_groups"]), **data_metrics}
            return self.restore(batch)
        return self.restore(self.actor_infer.collect(started))

    def restore(self, batch: Batch) -> Rollout:
        """A rollout of generated responses, their rewards to be scored (scored already: dynamic
        sampling with request pools)."""
        rewards = (RewardFuture.ready(lambda: self.scorer.metrics(batch)) if "scores" in batch
                   else self.scorer.future(batch))
        return self._rollout(batch, rewards, dict(self.ahead_metrics))

    # -- request pools (async_generation_ratio k >= 2) ---------------------------------------------------
    def _shares(self, total: int) -> List[int]:
        """`total` split over the rollout ranks, the first ones taking one more."""
        ranks = self.actor_infer.world_size
        return [total // ranks + (1 if rank < total % ranks else 0) for rank in range(ranks)]

    def _advance_pools(self, step: int, refill: Optional[List[dict]] = None, stream: str = "train") -> list:
        """Each rollout rank's pool advanced for `step`: new prompts for the groups it no longer
        holds (taken or dropped; all of them at the first call), quota its share of
        rollout_batch_size. `refill` (dynamic sampling's further rounds, same weights): those
        prompts instead, each rank returning as many complete groups as it takes new prompts; ranks
        with none are not advanced. Returns the calls (their ranks in `pool_ranks`)."""
        cfg = self.cfg
        held = self.pool_held or [0] * self.actor_infer.world_size
        if refill is None:
            quotas = self._shares(cfg.rollout_batch_size)
            # Each rank's pool is async_pool_batches of its own quota: split apart, an uneven split
            # could give a rank more than k quotas, which the staleness bound then drops.
            sizes = [math.ceil(cfg.async_pool_batches * quota) for quota in quotas]
            new = [max(0, size - count) for size, count in zip(sizes, held)]
            items = self.sampler.next_batch(size=sum(new)) if sum(new) else []
        else:
            new = quotas = self._shares(len(refill))
            items = refill
        prompts = self._prompt_batch(items, step, stream)
        starts = [sum(new[:rank]) for rank in range(len(new))]
        self.ahead_step = step
        self.pool_ranks = [rank for rank in range(len(new)) if refill is None or quotas[rank]]
        copy = {"with_state": True} if self.pool_copies is not None else {}
        return [self.actor_infer.call_async(
            rank, "advance", prompts.select(range(starts[rank], starts[rank] + new[rank])), quotas[rank], step,
            self.bound, gen=cfg.actor_infer.generating_args, **copy) for rank in self.pool_ranks]

    def _collect_pools(self, calls: list, counts: Dict[str, int]) -> Batch:
        """The advanced ranks' complete groups as one batch; their counts added to `counts`, the
        groups each holds now to `pool_held`."""
        results = self.actor_infer.gather(calls)
        held = self.pool_held or [0] * self.actor_infer.world_size
        for rank, (_, rank_counts, *state) in zip(self.pool_ranks, results):
            held[rank] = rank_counts["partial_groups"]
            for key, value in rank_counts.items():
                counts[key] = counts.get(key, 0) + value
            if self.pool_copies is not None and state:
                self.pool_copies[rank] = state[0]
        self.pool_held = held
        return Batch.concat([rows for rows, *_ in results])

    def pool_states(self) -> Optional[List[Any]]:
        """k >= 2: every rollout rank's held groups (what a checkpoint saves); None otherwise."""
        return self.actor_infer.execute_all("pool_state") if self.bound is not None else None

    def load_pool_states(self, states: Optional[List[Any]]) -> None:
        """The rollout ranks' held groups a checkpoint saved, before the first advance."""
        if self.bound is None or states is None:
            return
        workers = self.actor_infer.workers
        if len(states) != len(workers):
            raise ValueError(f"the checkpoint holds the request pools of {len(states)} rollout ranks, this run has "
                             f"{len(workers)}: resume with the same actor_infer world_size")
        self.actor_infer.gather([self.actor_infer.call_async(rank, "load_pool_state", s) for rank, s in enumerate(states)])
        self.pool_held = [len(s["held"]) if s else 0 for s in states]
        if self.pool_copies is not None:
            self.pool_copies = dict(enumerate(states))

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
        (adds `returns` too); use_opd: plus the teacher's dense per-token term; then ROLL's per-response
        loss weights."""
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

            batch["advantages"], opd_metrics = opd_advantages(
                batch["advantages"], batch["old_log_probs"], batch["teacher_log_probs"], batch["response_mask"],
                cfg.opd_kl_coef)
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
        """The prompt sampler's position and the running reward statistics (k >= 2: the drops so
        far and the metrics of the rollout generated ahead)."""
        state: Dict[str, object] = {"sampler": self.sampler.state_dict(),
                                    "running_stats": self.running_stats.state_dict() if self.running_stats else None}
        if self.bound is not None:
            state["request_pools"] = {"dropped_total": self.dropped_total, "ahead_metrics": self.ahead_metrics}
        return state

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Back to the sampler position and reward statistics a checkpoint saved."""
        self.sampler.load_state_dict(state["sampler"])
        if self.running_stats is not None and state.get("running_stats"):
            self.running_stats.load_state_dict(state["running_stats"])
        pools = state.get("request_pools")
        if self.bound is not None and isinstance(pools, dict):
            self.dropped_total = int(pools["dropped_total"])
            self.ahead_metrics = dict(pools["ahead_metrics"])


def _scale_counts(counts: Dict[str, int], total: int) -> Dict[str, int]:
    """`counts` (domain -> dropped groups) rescaled to sum to `total`, in proportion."""
    from roll_gspo.data.prompts import allot

    return allot(total, counts) if sum(counts.values()) != total else counts


def run_rlvr(cfg: PipelineConfig) -> Dict[str, float]:
    """Train `cfg`'s RLVR run to the end; the last step's metrics. A `warm_start` block runs (or a
    finished one is reused) first, and RL continues from its model (pipelines.rft_warm_start)."""
    from pipelines.rft_warm_start import warm_start

    return run_loop(warm_start(cfg), PromptGroupSource)
