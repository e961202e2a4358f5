"""RLVR pipeline (GSPO / GRPO with verifiable rewards).

Each step reads like the algorithm: generate G responses per prompt, reward them, score them
with the reference (when a KL key needs it) and with the trainer (old log-probs), compute
advantages, train ppo_epochs x mini-batches, sync the new weights into the rollout engine.

With `async_generation_ratio: 1` (one-step off-policy) the rollout engine generates step N+1's
responses while step N scores and trains: they are sampled by the weights of step N-1, and the
importance ratio's old log-probs are the rollout engine's own (the policy that sampled them).

Setting up (data, Ray clusters) lives in `pipelines.rlvr_setup`; saving, resuming and ending a run
in `pipelines.rlvr_checkpoint`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from contextlib import contextmanager
from typing import Dict, List, Optional

import ray
import torch

from roll_gspo.algorithms import RunningMeanStd, compute_advantages
from roll_gspo.lifecycle.checkpoint import resolve_resume
from roll_gspo.config import PipelineConfig
from roll_gspo.config.roll_compat import checkpoint_base
from roll_gspo.config.rollout_logprobs import choose_old_logprob_source
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import WorkerDiedError
from roll_gspo.lifecycle.graceful_stop import GracefulStop
from roll_gspo.models.causal_lm import build_sequences
from roll_gspo.models.moe_routing import folder_is_moe
from roll_gspo.lifecycle.seeding import rollout_seeds
from roll_gspo.metrics.recorder import MetricsTracker, plot_metrics

from pipelines.common import prepare_models, progress_bar
from pipelines.rlvr_critic import (actor_trains, collect_values, critic_view, gae_advantages_and_returns,
    start_values)
from pipelines.rlvr_checkpoint import (announce_stop, checkpoint_due, load_next_rollout, restore_trainer_and_data,
    resumed_old_logprobs, save_final_model, write_checkpoint)
from pipelines.rlvr_setup import (REWARD_WORKER_RESTARTS, check_domains, load_prompts, log_colocation, reward_routes,
    start_clusters)

logger = logging.getLogger("roll_gspo")
TRAINER_TENSORS = ("input_ids", "attention_mask", "prompt_lengths", "response_mask", "old_log_probs",
                   "advantages", "ref_log_probs", "rollout_log_probs", "loss_mask",
                   "routed_experts")
_log_colocation = log_colocation  # its name here before it moved to rlvr_setup (tests import it)


class RLVRPipeline:
    def __init__(self, cfg: PipelineConfig):
        from transformers import AutoTokenizer

        from roll_gspo.data.prompts import PromptSampler

        self.cfg = cfg
        prepare_models(cfg, ["actor_train", "actor_infer", "reference"] + (["critic"] if cfg.uses_critic() else []))
        self.resume_dir = resolve_resume(checkpoint_base(cfg), cfg.resume_from_checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor_train.model_args.model_name_or_path)
        self.old_logprobs = choose_old_logprob_source(
            cfg, model_is_moe=folder_is_moe(cfg.actor_train.model_args.model_name_or_path))
        logger.info("old log-probs from the %s (%s)", self.old_logprobs.source, self.old_logprobs.reason)
        # Data: every row's domain must route to a reward block before any worker starts.
        self.domain_of_worker = reward_routes(cfg)
        self.train_items, stats = load_prompts(cfg, self.tokenizer, cfg.actor_train.data_args)
        self.filtered_prompts = stats["filtered_prompts"]
        self.val_items = (load_prompts(cfg, self.tokenizer, cfg.validation.data_args)[0]
                          if cfg.validation.data_args.file_name or cfg.tasks else [])
        check_domains(self.train_items + self.val_items, self.domain_of_worker)
        self.sampler = PromptSampler(self.train_items, cfg.rollout_batch_size, seed=cfg.seed,
                                     shuffle=cfg.actor_train.data_args.shuffle,
                                     domain_probs=self._mix(),
                                     domain_of=lambda item: self._mix_key(item["domain"]))
        self.query_filters = {name: reward.query_filter_config for name, reward in cfg.rewards.items()
                              if reward.query_filter_config.type != "no_filter"}
        # Driver state that a checkpoint saves or that lives across steps.
        self.running_stats = RunningMeanStd() if cfg.reward_norm == "running" else None
        self.start_step = 0
        self.next_rollout = None  # async_generation_ratio 1: the next step's responses, generated ahead
        self.reward_worker_restarts = 0  # since the last step's metrics
        self.stopped_by = None  # the signal that stopped run() early, if one did
        self.offload = log_colocation(cfg)
        # Workers: Ray, the GPU reservation, one cluster per role (then the checkpoint, if resuming).
        clusters = start_clusters(cfg)
        self.placement, self.actor_train, self.actor_infer = (clusters.placement, clusters.actor_train,
                                                              clusters.actor_infer)
        self.reference, self.rewards = clusters.reference, clusters.rewards
        self.critic = clusters.critic  # PPO (adv_estimator: gae): the value model's ranks; None otherwise
        if self.resume_dir:
            self._load_checkpoint(self.resume_dir)
        elif cfg.actor_train.model_args.adapter_name_or_path:  # the rollout engine starts from the base model
            self.sync_weights(version=0)

    def _mix(self) -> Dict[str, float]:
        """The training mix (domain -> share): each task's weight with `tasks`, else ROLL's
        domain_interleave_probs over reward blocks."""
        tasks = self.cfg.tasks
        return {k: t.weight for k, t in tasks.items()} if tasks else self.cfg.actor_train.data_args.domain_interleave_probs

    def _mix_key(self, domain: str) -> str:
        """What a row's domain counts as in the mix: the task (with `tasks`), else its reward block."""
        return domain if self.cfg.tasks else self.domain_of_worker[domain]

    # -- one step -----------------------------------------------------------------------------------
    def step(self, step: int) -> Dict[str, float]:
        """One RL iteration, in the algorithm's order:

        1. rollout: G responses per prompt (`_rollout`: dynamic sampling scores and filters them
           already; async: this step's were generated during the last one, the next step's start);
        2. shared GPUs: the rollout engine offloads, freeing its memory for the passes below;
        3. log-probs of the responses: the reference's (a KL term) and the old policy's (the
           trainer's pass, or the rollout engine's own); the reward workers score meanwhile;
        4. rewards, then advantages (`adv_estimator`, optional KL penalty) and per-response loss weights;
           PPO (gae): the critic's values, scored beside the log-probs, and GAE over them;
        5. train ppo_epochs x mini-batches (PPO: the critic each step, the actor after critic_warmup steps);
        6. every model_update_frequency steps, the new weights into the rollout engine (within the
           train call when generation is synchronous; async: once the next rollout is complete);
        7. the step's metrics.
        """
        timings: Dict[str, float] = {}
        batch, ahead, pending_rewards, sampling_metrics = self._rollout(step, timings)
        if self.offload:  # shared GPUs: the rollout engine frees its memory for the scoring and training passes
            with _timed(timings, "offload"):
                sampling_metrics.update(_mean_over_ranks(self.actor_infer.execute_all("offload_states")))
        self._add_sequence_tensors(batch)
        value_calls = start_values(self.critic, batch) if self.critic is not None else None
        pending_rewards = self._score_log_probs(batch, pending_rewards, timings)
        with _timed(timings, "reward"):  # what is left of scoring once the log-prob passes are done
            self._collect_rewards(batch, self._rewards_started(batch, pending_rewards))
        reward_metrics = self._reward_metrics(batch)
        if value_calls is not None:
            with _timed(timings, "values"):  # what is left of the critic's pass
                batch["values"] = collect_values(self.critic, value_calls)
        with _timed(timings, "advantages"):
            batch["advantages"], adv_metrics = self._advantages(batch)
            adv_metrics.update(self._apply_sample_weights(batch))
        train_metrics, sync_metrics = self._train_and_sync(step, batch, timings, ahead)
        return {**reward_metrics, **sampling_metrics, **adv_metrics, **train_metrics, **sync_metrics,
                **self._step_metrics(step, batch, timings)}

    # -- the step's phases --------------------------------------------------------------------------
    def _train_and_sync(self, step: int, batch: Batch, timings: Dict[str, float], ahead: Optional[list] = None):
        """Train on the batch and, when due, sync the new weights into the rollout engine (within
        the train call when generation is synchronous; async: once the rollout generating `ahead`
        is complete). Returns the training metrics and the sync's (`sync/*`, empty without one)."""
        cfg = self.cfg
        sync_due = step % cfg.model_update_frequency == 0
        train_actor = actor_trains(cfg, step)  # PPO: not during critic_warmup
        sync_in_train = sync_due and not cfg.async_generation_ratio and train_actor
        with _timed(timings, "train"):
            critic_calls = (self.critic.dispatch_async("train_step", critic_view(batch)) if self.critic is not None
                            else None)
            # With a sync due, the ranks send the new weights to the rollout ranks at the end of the
            # same call (one driver round trip less); its own time is the `sync` phase.
            per_rank = self.actor_train.dispatch("train_step", self._view(batch), weight_version=step,
                                                 sync_to=self.actor_infer.workers if sync_in_train else None
                                                 ) if train_actor else None
            critic_metrics = _mean_over_ranks(self.critic.collect(critic_calls)) if critic_calls else {}
        train_metrics, sync_metrics = _split_sync_metrics(per_rank) if per_rank else ({}, {})
        train_metrics.update(critic_metrics)
        self._follow_logprob_gap(step, train_metrics.get("rollout/logprob_gap"))
        if ahead is not None:  # async: the rollout must be complete before the engine takes new weights
            with _timed(timings, "generate"):
                self.next_rollout = self.actor_infer.collect(ahead)
        if sync_due and not sync_in_train:
            sync_metrics = self.sync_weights(version=step)
        if sync_due:
            timings["sync"] = sync_metrics["sync/seconds"]
            timings["train"] -= timings["sync"] if sync_in_train else 0.0
        return train_metrics, sync_metrics

    def _rollout(self, step: int, timings: Dict[str, float]):
        """This step's responses. Returns the batch; the calls generating the next step's rollout
        (async, else None); the reward calls pending (`[]`: scored already; None: not started, so
        that the CPU reward workers score while the first log-prob pass runs); `data/*` metrics."""
        cfg = self.cfg
        if self.query_filters:  # dynamic sampling: scores first, regenerate for dropped prompts
            batch, sampling_metrics = self._generate_informative_groups(self.sampler.next_batch(), step, timings)
            return batch, None, [], sampling_metrics
        with _timed(timings, "generate"):
            batch, self.next_rollout = self.next_rollout, None
            if batch is None:
                batch = self._generate(self.sampler.next_batch(), step, "train")
        ahead = None
        if cfg.async_generation_ratio and step < cfg.max_steps:
            ahead = self._start_generate(self.sampler.next_batch(), step + 1, "train")
        return batch, ahead, None, {}

    def _score_log_probs(self, batch: Batch, pending_rewards: Optional[list], timings: Dict[str, float]):
        """Adds `ref_log_probs` (with a reference) and `old_log_probs` (and MoE `routed_experts`) to
        the batch. The reward calls start, if they have not, right after the first pass is sent, so
        that both run at once; returns them."""
        view = self._view(batch)  # both passes read the same tensors
        if self.reference is not None:
            with _timed(timings, "reference"):
                calls = self.reference.dispatch_async("compute_log_probs", view)
                pending_rewards = self._rewards_started(batch, pending_rewards)
                batch["ref_log_probs"] = self.reference.collect(calls)["ref_log_probs"]
        elif self.cfg.needs_reference_log_probs():  # LoRA: the reference is the trainer without its adapter
            with _timed(timings, "reference"):
                calls = self.actor_train.dispatch_async("compute_log_probs", view, adapter_disabled=True)
                pending_rewards = self._rewards_started(batch, pending_rewards)
                batch["ref_log_probs"] = self.actor_train.collect(calls)["ref_log_probs"]
        if self.old_logprobs.source == "trainer":
            with _timed(timings, "old_log_probs"):
                calls = self.actor_train.dispatch_async("compute_log_probs", view)
                pending_rewards = self._rewards_started(batch, pending_rewards)
                scored = self.actor_train.collect(calls)
                batch["old_log_probs"] = scored["old_log_probs"]
                if "routed_experts" in scored:  # MoE: the experts the old policy chose (replay, volatility)
                    batch["routed_experts"] = scored["routed_experts"]
        else:  # the rollout engine's log-probs are the trainer's (choose_old_logprob_source): no pass
            batch["old_log_probs"] = batch["rollout_log_probs"]
        return pending_rewards

    def _rewards_started(self, batch: Batch, pending: Optional[list]) -> list:
        """`pending`, or the reward calls started now when there are none yet."""
        return pending if pending is not None else self._start_rewards(batch)

    def _step_metrics(self, step: int, batch: Batch, timings: Dict[str, float]) -> Dict[str, float]:
        """Phase times, response lengths, rollout staleness, throughput and data position."""
        step_seconds = sum(timings.values())
        lengths = batch["response_mask"].sum(-1)
        return {
            **{f"time/{k}_s": v for k, v in timings.items()}, "time/step_s": step_seconds,
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/truncated_frac": 1.0 - sum(batch["finished"]) / len(batch),
            # Steps between the weights that sampled this rollout and those it trains (step - 1).
            "rollout/staleness": float(step - 1 - min(batch["weight_version"])),
            "rollout/weight_version": float(min(batch["weight_version"])),
            "throughput/tokens_per_s": float(lengths.sum()) / max(step_seconds, 1e-9),
            "data/epoch": float(self.sampler.epoch), "data/filtered_prompts": float(self.filtered_prompts),
            "rollout/old_logprobs_from_rollout": float(self.old_logprobs.source == "rollout"),
        }

    def _follow_logprob_gap(self, step: int, gap) -> None:
        """auto outside fp32: the rollout engine's old log-probs while the measured trainer-rollout
        gap (first mini-batch, before any update) stays below the threshold, the trainer's otherwise."""
        choice = self.old_logprobs
        if choice.max_gap is None or gap is None:
            return
        wanted = "rollout" if gap < choice.max_gap else "trainer"
        if wanted != choice.source:
            reason = (f"auto: the mean trainer-rollout gap at step {step} is {gap:.3g}, "
                      f"{'below' if wanted == 'rollout' else 'above'} old_logprob_auto_max_gap = {choice.max_gap:g}")
            self.old_logprobs = dataclasses.replace(choice, source=wanted, reason=reason)
            logger.info("old log-probs from the %s from step %d on (%s)", wanted, step + 1, reason)

    # -- rollouts -----------------------------------------------------------------------------------
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

    def _start_generate(self, items: List[dict], step: int, stream: str) -> list:
        """`_generate` without waiting: the calls, for `actor_infer.collect`."""
        return self.actor_infer.dispatch_async("generate", self._prompt_batch(items, step, stream), skip_empty=True,
                                               gen=self.cfg.actor_infer.generating_args)

    def _generate_informative_groups(self, prompts: List[dict], step: int, timings: Dict[str, float]):
        """Dynamic sampling (ROLL's query_filter_config): generate and score, drop the groups their
        domain's filter rejects, and generate for as many new prompts of the same domains until
        rollout_batch_size groups are kept or query_filter_max_rounds generations were made; then
        top up with dropped groups. Returns the scored batch and `data/*` metrics."""
        cfg, group = self.cfg, self.cfg.num_return_sequences_in_group
        kept, dropped = [], []
        rounds = extra_prompts = 0
        while True:
            rounds += 1
            with _timed(timings, "generate"):  # each round its own seeds (exact resume)
                batch = self._generate(prompts, step, "train" if rounds == 1 else f"train-round{rounds}")
            with _timed(timings, "reward"):
                self._collect_rewards(batch, self._start_rewards(batch))
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

    # -- rewards ------------------------------------------------------------------------------------
    def _start_rewards(self, batch: Batch) -> list:
        """Send every response (its meta: texts, token ids, ground truth, domain; not the
        trainer's tensors) to its domain's reward cluster; returns what to collect."""
        responses = Batch(meta=batch.meta)
        pending = []
        for name, cluster in self.rewards.items():
            rows = [i for i, d in enumerate(batch["domain"]) if self.domain_of_worker[d] == name]
            if rows:
                shards = responses.select(rows).chunk(cluster.world_size)
                refs = [w.compute_scores.remote(s) for w, s in zip(cluster.workers, shards)]
                pending.append((rows, refs))
        return pending

    def _collect_rewards(self, batch: Batch, pending: list) -> None:
        """Wait for the scores; adds tensor `scores` and meta `reward_status` / `reward_correct` /
        `reward_metrics` to the batch (nothing when `pending` is empty: the batch was scored already)."""
        if not pending and "scores" in batch:
            return
        scores = torch.zeros(len(batch))
        statuses, correct, row_metrics = [""] * len(batch), [None] * len(batch), [None] * len(batch)
        restarts = 0
        for rows, refs in pending:
            try:
                result = Batch.concat(ray.get(refs))
            except ray.exceptions.RayActorError as exc:  # restarts exhausted
                raise WorkerDiedError(f"a reward worker died {REWARD_WORKER_RESTARTS} times; the last time: "
                                      f"{str(exc).splitlines()[0]}") from exc
            restarts += sum(result.meta.get("worker_restarted", []))
            scores[rows] = result["scores"]
            for i, status, right in zip(rows, result["reward_status"], result["reward_correct"]):
                statuses[i], correct[i] = status, right
            for i, named in zip(rows, result.meta.get("reward_metrics", ())):  # a custom worker may send none
                row_metrics[i] = named
        batch["scores"], batch["reward_status"], batch["reward_correct"] = scores, statuses, correct
        batch["reward_metrics"] = row_metrics
        self.reward_worker_restarts += restarts

    def _reward_metrics(self, batch: Batch, prefix: str = "reward") -> Dict[str, float]:
        """Reward metrics, overall and per data domain (`<prefix>/<domain>/mean`, `.../errors`,
        `.../timeouts`, `.../format`, and the means of the numbers its worker reports per response,
        e.g. IFEval's accuracies); training steps also report the reward workers restarted."""
        scores, statuses = batch["scores"], batch["reward_status"]
        row_metrics = batch["reward_metrics"] if "reward_metrics" in batch else [None] * len(batch)
        metrics = _reward_metrics(prefix, scores, statuses)
        domains = batch["domain"]
        for domain in sorted(set(domains)):
            rows = [i for i, d in enumerate(domains) if d == domain]
            metrics.update(_reward_metrics(f"{prefix}/{domain}", scores[rows], [statuses[i] for i in rows]))
            metrics.update(_row_metric_means(f"{prefix}/{domain}", [row_metrics[i] for i in rows]))
        if prefix == "reward":
            metrics["reward/worker_restarts"], self.reward_worker_restarts = float(self.reward_worker_restarts), 0
        return metrics

    # -- trainer tensors, advantages, weight sync ------------------------------------------------------
    def _add_sequence_tensors(self, batch: Batch) -> None:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids, attention, prompt_lengths, response_mask = build_sequences(
            batch["prompt_ids"], batch["response_ids"], pad)
        batch["input_ids"], batch["attention_mask"] = input_ids, attention
        batch["prompt_lengths"], batch["response_mask"] = prompt_lengths, response_mask

    def _view(self, batch: Batch) -> Batch:
        """Only the tensors the training/reference ranks read (less to serialise)."""
        return Batch({k: v for k, v in batch.tensors.items() if k in TRAINER_TENSORS})

    def _advantages(self, batch: Batch):
        cfg = self.cfg
        if self.critic is not None:  # PPO: GAE over the critic's values (adds `returns` too)
            metrics = gae_advantages_and_returns(cfg, batch, self.running_stats)
            return batch["advantages"], metrics
        kl = None
        if cfg.add_token_level_kl:
            kl = batch["old_log_probs"] - batch["ref_log_probs"]
        return compute_advantages(
            batch["scores"], batch["response_mask"], group_size=cfg.num_return_sequences_in_group,
            adv_estimator=cfg.adv_estimator, reward_norm=cfg.reward_norm, reward_shift=cfg.reward_shift,
            reward_scale=cfg.reward_scale, reward_clip=cfg.reward_clip, running_stats=self.running_stats,
            kl=kl, kl_coef=cfg.init_kl_coef if kl is not None else 0.0,
            whiten_advantages=cfg.whiten_advantages, advantage_clip=cfg.advantage_clip)

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

    def sync_weights(self, version: Optional[int] = None) -> Dict[str, float]:
        """The trainer's weights (those of pipeline step `version`; None keeps the rollout ranks'
        stamp) into every rollout rank."""
        results = self.actor_train.execute_all("sync_weights_to", self.actor_infer.workers, version)
        return results[0]

    # -- validation, checkpoints, the loop ------------------------------------------------------------
    def validate(self, step: int) -> Dict[str, float]:
        if not self.val_items:
            return {}
        start = time.perf_counter()
        prompts = self._prompt_batch(self.val_items, step, "validation")
        batch = self.actor_infer.dispatch("generate", prompts, gen=self.cfg.validation.generating_args)
        self._collect_rewards(batch, self._start_rewards(batch))
        metrics = self._reward_metrics(batch, prefix="val")
        metrics = {k.replace("/mean", "/reward_mean") if k.endswith("/mean") else k: v for k, v in metrics.items()
                   if not k.endswith("/std")}
        metrics.update(_accuracies(batch["domain"], batch["reward_correct"]))
        metrics.update(_sample_metrics(batch, self.cfg.validation.generating_args.num_return_sequences))
        return {**metrics, "val/samples": float(len(batch)), "time/validation_s": time.perf_counter() - start}

    def save_checkpoint(self, step: int) -> str:
        """Written to a temporary folder, fsynced, renamed into place (`roll_gspo.lifecycle.checkpoint`)."""
        return write_checkpoint(self.cfg, self.actor_train, step, next_rollout=self.next_rollout,
                                sampler=self.sampler, running_stats=self.running_stats, old_logprobs=self.old_logprobs,
                                critic=self.critic)

    def _load_checkpoint(self, folder: str) -> None:
        state = restore_trainer_and_data(folder, self.actor_train, self.sampler, self.running_stats, critic=self.critic)
        self.start_step = int(state["step"])
        self.old_logprobs = resumed_old_logprobs(self.old_logprobs, state, self.start_step)  # where the gap had led
        self.sync_weights(version=self.start_step)  # the rollout engine starts from `pretrain`
        self.next_rollout = load_next_rollout(folder, default=self.next_rollout)
        logger.info("resumed from %s at step %d", folder, self.start_step)

    def run(self) -> Dict[str, float]:
        """The step loop. SIGTERM / SIGINT: the step in progress finishes, a checkpoint is saved
        and run returns (a second signal stops at once)."""
        cfg = self.cfg
        tracker = MetricsTracker(cfg.output_dir, cfg.logging_dir, cfg.track_with, cfg.tracker_kwargs,
                                 resume_step=self.start_step if self.resume_dir is not None else None,
                                 exp_name=cfg.exp_name, config=dataclasses.asdict(cfg))
        last: Dict[str, float] = {}
        try:
            with GracefulStop() as stop:
                if cfg.eval_steps and self.start_step == 0:
                    first = self.validate(0)
                    tracker.log(0, first)
                    logger.info(MetricsTracker.console_line(0, cfg.max_steps, first))
                with progress_bar(range(self.start_step + 1, cfg.max_steps + 1), cfg.exp_name) as steps:
                    for step in steps:
                        metrics = self.step(step)
                        if cfg.eval_steps and (step % cfg.eval_steps == 0 or step == cfg.max_steps):
                            metrics.update(self.validate(step))
                        tracker.log(step, metrics)
                        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                            logger.info(MetricsTracker.console_line(step, cfg.max_steps, metrics))
                        last = metrics
                        if checkpoint_due(cfg, step, stop):
                            folder = self.save_checkpoint(step)
                        if stop.requested and step < cfg.max_steps:
                            self.stopped_by = stop.requested
                            announce_stop(stop.requested, step, cfg.max_steps, folder)
                            break
            if self.stopped_by is None:
                save_final_model(cfg, self.actor_train)
        finally:
            tracker.close()
        plot_metrics(tracker.path, os.path.join(cfg.output_dir, "metrics.png"), cfg.exp_name)
        return last

    def shutdown(self) -> None:
        clusters = [self.actor_train, self.actor_infer, self.reference, self.critic, *self.rewards.values()]
        for cluster in clusters:
            if cluster is not None:
                cluster.shutdown()
        if self.placement is not None:
            self.placement.shutdown()


@contextmanager
def _timed(timings: Dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start  # phases may repeat


def _scale_counts(counts: Dict[str, int], total: int) -> Dict[str, int]:
    """`counts` (domain -> dropped groups) rescaled to sum to `total`, in proportion."""
    from roll_gspo.data.prompts import allot

    return allot(total, counts) if sum(counts.values()) != total else counts


def _reward_metrics(prefix: str, scores: torch.Tensor, statuses: List[str]) -> Dict[str, float]:
    return {f"{prefix}/mean": float(scores.mean()),
            f"{prefix}/std": float(scores.std()) if len(scores) > 1 else 0.0,
            f"{prefix}/errors": float(statuses.count("error")), f"{prefix}/timeouts": float(statuses.count("timeout")),
            f"{prefix}/format": float(statuses.count("format"))}


def _row_metric_means(prefix: str, rows: List[Optional[Dict[str, float]]]) -> Dict[str, float]:
    """`<prefix>/<name>`: the mean of each number reward workers reported per response, over the
    responses that reported it."""
    values: Dict[str, List[float]] = {}
    for named in rows:
        for name, value in (named or {}).items():
            values.setdefault(name, []).append(value)
    return {f"{prefix}/{name}": sum(vs) / len(vs) for name, vs in values.items()}


def _accuracies(domains: List[str], correct: List) -> Dict[str, float]:
    """`val/accuracy`: the fraction of responses whose reward worker judged them correct (raw
    score at full marks, before length penalties), overall and per domain; domains whose worker
    has no notion of correct (a reward model) are left out."""
    def fraction(flags):
        flags = [f for f in flags if f is not None]
        return {"accuracy": sum(flags) / len(flags)} if flags else {}

    out = {f"val/{k}": v for k, v in fraction(correct).items()}
    for domain in sorted(set(domains)):
        flags = [c for d, c in zip(domains, correct) if d == domain]
        out.update({f"val/{domain}/{k}": v for k, v in fraction(flags).items()})
    return out


def _sample_metrics(batch: Batch, n: int) -> Dict[str, float]:
    """`val/pass@k` and `val/maj@k` (n samples per prompt; k = 1, 2, 4, .., n), overall and per
    domain, from the workers' verdicts and the replies' extracted answers: the evaluation command's
    code (roll_gspo.tasks.sample_metrics)."""
    from roll_gspo.rewards.answers import extract_answer
    from roll_gspo.tasks import grouped_sample_metrics

    answers = [extract_answer(text) for text in batch["response_text"]]
    found = grouped_sample_metrics(batch["domain"], batch["reward_correct"], answers, n)
    return {f"val/{k}": v for k, v in found.items()}


def _split_sync_metrics(per_rank: List[Dict[str, float]]):
    """Training metrics merged over ranks, and the weight sync's (`sync/*`) as rank 0, the
    sender, measured them (empty without a sync)."""
    train = [{k: v for k, v in metrics.items() if not k.startswith("sync/")} for metrics in per_rank]
    return _mean_over_ranks(train), {k: v for k, v in per_rank[0].items() if k.startswith("sync/")}


def _mean_over_ranks(per_rank: List[Dict[str, float]]) -> Dict[str, float]:
    """Means of per-rank metrics; extremes (`*_min`, `*_max`) stay extremes."""
    merged = {}
    for key in per_rank[0]:
        values = [r[key] for r in per_rank]
        merged[key] = min(values) if key.endswith("_min") else max(values) if key.endswith("_max") else sum(values) / len(values)
    return merged


def run_rlvr(cfg: PipelineConfig) -> Dict[str, float]:
    pipeline = RLVRPipeline(cfg)
    try:
        return pipeline.run()
    finally:
        pipeline.shutdown()
