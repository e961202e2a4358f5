"""The trainer loop every RL pipeline runs: it takes each step's rollout from a source (prompt groups
for RLVR, episodes for agentic runs; `pipelines.sources`), scores it with the reference and the old
policy, estimates advantages, trains ppo_epochs x mini-batches, syncs the new weights into the
rollout engine, and around the steps: validation, checkpoints, metrics, the final model.

The run plan decides the rollout mode once (`RunPlan.rollout_depth`, `RunPlan.staleness_bound`) and
everything here reads it. With `async_generation_ratio: 1` the rollout buffer between source and
loop is one step deep (`pipelines.rollout_buffer`): the rollout engine generates step N+1's
responses while step N scores and trains; they are sampled by the weights of step N-1, and the
importance ratio's old log-probs are the rollout engine's own (the policy that sampled them). With
`async_generation_ratio` k >= 2 the buffer has the same shape, and the source the pipeline's
`make_source` picks for the plan takes its rollouts from pools (pipelines.pools) whose responses
may span several weight versions (partial rollouts); the loop checks that none is trained more
than k versions after its oldest token was sampled, logs the staleness histogram and gives the
trainer each token's lag (the log-prob gap per lag; docs/async.md).

Setting up (Ray clusters) lives in `pipelines.setup`; saving, resuming and ending a run in
`pipelines.checkpoint`; PPO's critic in `pipelines.critic`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Dict, List, Optional, Sequence, Tuple

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.lifecycle.checkpoint import checkpoint_base
from roll_gspo.config.plan.run_plan import RunPlan, build_run_plan
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.batch_fields import RESPONSE_RATIOS, TRAINER_TENSORS, view
from roll_gspo.distributed.cluster import WorkerDiedError
from roll_gspo.distributed.fault_tolerance import phase_of, regeneration_note
from roll_gspo.distributed.replaceable import ReplaceableCluster
from roll_gspo.lifecycle.checkpoint import resolve_resume
from roll_gspo.lifecycle.reshape import ResumeAction, prepare_resume, resume_actions
from roll_gspo.lifecycle.graceful_stop import GracefulStop
from roll_gspo.metrics.drift import TRAINER_GAPS
from roll_gspo.metrics.recorder import MetricsTracker, plot_metrics
from roll_gspo.metrics.rollouts import RolloutWriter
from roll_gspo.metrics.stalls import StallWatch
from roll_gspo.report import REPORT_FILE, write_report
from roll_gspo.models.moe_routing import folder_is_moe
from roll_gspo.sync.broadcast import RECEIVER_LOST, UNRESPONSIVE_RECEIVERS

from pipelines.checkpoint import (announce_stop, checkpoint_due, load_buffered, load_pool_states, restore_trainer,
    resumed_old_logprobs, save_final_model, write_checkpoint)
from pipelines.common import prepare_models, progress_bar, timed
from pipelines.critic import actor_trains, collect_values, critic_view, start_values
from pipelines.drift_watch import DriftWatch
from pipelines.endpoint import start_endpoint, stop_endpoint
from pipelines.rollout_buffer import RolloutBuffer
from pipelines.rollout_records import train_records
from pipelines.setup import log_colocation, start_clusters
from pipelines.sources import MakeSource, RewardFuture, Rollout, add_sequence_tensors
from pipelines.teacher import teacher_view

logger = logging.getLogger("roll_gspo")


class TrainerLoop:
    """Owns the clusters and trains on what `source` produces: log-prob passes, advantages (the
    source's estimate), train and sync, checkpoints, metrics, the run loop."""

    def __init__(self, cfg: PipelineConfig, make_source: MakeSource):
        from transformers import AutoTokenizer

        self.cfg = cfg = prepare_models(cfg, _roles_with_models(cfg))
        self.resume_dir, self.resume_actions = self._resolve_resume(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor_train.model_args.model_name_or_path)
        self.plan = self._plan(cfg)  # what the run decided: the loop, the source and the workers read it
        self.old_logprobs = self.plan.old_logprobs  # `auto` may move it during the run (_follow_logprob_gap)
        self.source = make_source(cfg, self.tokenizer, self.plan)  # its data (or envs), before any worker starts
        self.buffer = RolloutBuffer(self.source, self.plan.rollout_depth, last_step=cfg.max_steps)
        self.response_ratios: Dict[int, tuple] = {}  # the last train call's {row: (ratio, clipped)}
        self.stalls = StallWatch()  # a phase far above its median, throughput collapsing: one line each
        self.drift = DriftWatch(self.plan.drift, checkpoint_base(cfg))  # the trainer-vs-engine gap, judged each step
        self.trainer_gaps: Dict[int, object] = {}  # the last train call's {row: per-token gaps}
        self.rollout_files = RolloutWriter(cfg.rollout_dump_dir if cfg.rollout_dump_samples else None,
                                           cfg.validation_data_dir)
        self.start_step = self.trained_step = 0  # trained_step: the step of the trainer's weights
        self.stopped_by = None  # the signal that stopped run() early, if one did
        self.offload = log_colocation(cfg, self.plan)
        self._start_roles()
        self._prepare_rank_replacement()
        self._restore_or_first_sync()

    # -- starting up ---------------------------------------------------------------------------------
    @staticmethod
    def _resolve_resume(cfg: PipelineConfig) -> Tuple[Optional[str], List[ResumeAction]]:
        """The checkpoint folder to resume from (None: a fresh run) and what resuming it takes. Another
        training shape than the checkpoint's is refused here, before any worker starts, or converted
        here (DeepSpeed's universal checkpoint) for the workers to load."""
        resume_dir = resolve_resume(checkpoint_base(cfg), cfg.resume_from_checkpoint)
        actions = resume_actions(cfg, resume_dir) if resume_dir else []
        for action in actions:
            (logger.info if action.kind == "exact" else logger.warning)("resume: %s", action.line())
        if resume_dir:
            prepare_resume(resume_dir, actions)
        return resume_dir, actions

    @staticmethod
    def _plan(cfg: PipelineConfig) -> RunPlan:
        """The run's decisions (offload, old log-probs, reference, routes, the rollout mode), the
        policy's MoE-ness read from its built folder; where the old log-probs come from is logged."""
        plan = build_run_plan(cfg, model_is_moe=folder_is_moe(cfg.actor_train.model_args.model_name_or_path))
        logger.info("old log-probs from the %s (%s)", plan.old_logprobs.source, plan.old_logprobs.reason)
        return plan

    def _start_roles(self) -> None:
        """Ray, the GPU reservation, one cluster per role, the rollout endpoint; the source connected."""
        cfg = self.cfg
        clusters = start_clusters(cfg, self.plan)
        self.placement, self.actor_train, self.actor_infer = (clusters.placement, clusters.actor_train,
                                                              clusters.actor_infer)
        self.reference, self.rewards = clusters.reference, clusters.rewards
        self.critic = clusters.critic  # PPO (adv_estimator: gae): the value model's ranks; None otherwise
        self.teachers = clusters.teachers  # use_opd: role name -> the frozen teacher's ranks; empty otherwise
        clusters.endpoint = self.endpoint = start_endpoint(cfg, clusters, self.tokenizer)  # rollout_endpoint
        self.source.connect(clusters)

    def _prepare_rank_replacement(self) -> None:
        """Rollout ranks that die or hang are replaced (roll_gspo.distributed.replaceable): a new one
        gets the trainer's weights (`_give_weights`); `rollout_version` is the step of the weights the
        rollout ranks hold, `weights_synced` whether the trainer's are still those (then the new rank
        samples exactly what the lost one would have)."""
        self.rollout_version, self.weights_synced = 0, True
        # During a sync that lost a rank: the version that sync stamps (None: the ranks' own).
        self.resyncing, self.resync_version = False, None
        self.replaceable = self.actor_infer if isinstance(self.actor_infer, ReplaceableCluster) else None
        if self.replaceable is not None:
            self.replaceable.on_replaced.append(self._give_weights)

    def _restore_or_first_sync(self) -> None:
        """Resuming: the checkpoint's state, the rollout engine then holding the trainer's weights. A
        run that starts from a LoRA adapter: the rollout engine, started from the base model, takes it."""
        if self.resume_dir:
            self._load_checkpoint(self.resume_dir)
        elif self.cfg.actor_train.model_args.adapter_name_or_path:
            self.sync_weights(version=0)

    # -- one step -----------------------------------------------------------------------------------
    def step(self, step: int) -> Dict[str, float]:
        """One RL iteration, in the algorithm's order:

        1. the rollout (the source's samples; async: generated during the last step, the next starts);
        2. shared GPUs: the rollout engine offloads, freeing its memory for the passes below;
        3. log-probs of the responses: the reference's (a KL term) and the old policy's (the
           trainer's pass, or the rollout engine's own); the reward workers score meanwhile;
           PPO: the critic's values, scored beside them;
        4. the rewards, then advantages (the source's estimate: per group, GAE, per trajectory or turn);
        5. train ppo_epochs x mini-batches (PPO: the critic each step, the actor after critic_warmup steps);
        6. every model_update_frequency steps, the new weights into the rollout engine;
        7. the step's metrics.
        """
        timings: Dict[str, float] = {}
        rollout = self.buffer.take(step, timings)
        batch, metrics = rollout.batch, dict(rollout.metrics)
        bound = self.plan.staleness_bound
        if bound is not None and rollout.trainable:
            metrics.update(self._check_staleness(step, batch, bound))
        if not rollout.trainable:  # not one generated token (agentic: every episode ended at its opening)
            return {**metrics, **self._step_metrics(step, rollout, timings)}
        if self.offload:  # shared GPUs: the rollout engine frees its memory for the passes below
            with timed(timings, "offload"):
                metrics.update(_mean_over_ranks(self.actor_infer.execute_all("offload_states")))
        value_calls = start_values(self.critic, batch) if self.critic is not None else None
        self._score_log_probs(batch, rollout.rewards, timings)
        reward_metrics = rollout.rewards.result(timings)  # what is left of scoring once the passes are done
        if value_calls is not None:
            with timed(timings, "values"):  # what is left of the critic's pass
                batch["values"] = collect_values(self.critic, value_calls)
        with timed(timings, "advantages"):
            batch["advantages"], adv_metrics = self.source.advantages(batch)
        train_metrics, sync_metrics = self._train_and_sync(step, batch, timings)
        metrics.update(self.drift.observe(step, batch, self.trainer_gaps))  # one line per breach, drift/*
        with timed(timings, "record"):  # the rollout file: what the model said (docs/rollouts.md)
            record_metrics = self.rollout_files.write("train", step, train_records(
                batch, step, self.cfg.rollout_dump_samples, self.cfg.num_return_sequences_in_group,
                self.response_ratios, self.trainer_gaps))
        return {**reward_metrics, **metrics, **adv_metrics, **train_metrics, **sync_metrics, **record_metrics,
                **self._step_metrics(step, rollout, timings)}

    # -- the step's phases --------------------------------------------------------------------------
    def _score_log_probs(self, batch: Batch, rewards: RewardFuture, timings: Dict[str, float]) -> None:
        """Adds `ref_log_probs` (with a reference), `teacher_log_probs` and `teacher_kl_coef` (use_opd)
        and `old_log_probs` (and MoE `routed_experts`) to the batch. The rewards start right after the
        first pass is sent, so that both run at once. (Sending every pass before awaiting any was
        measured on SmolLM2 with a teacher: no faster, the passes then share the two cores.)"""
        view = self._view(batch)  # the passes read the same tensors
        if self.teachers:  # on-policy distillation: the teachers score the sampled tokens
            with timed(timings, "teacher"):
                sent = self._send_to_teachers(batch, view)
                rewards.start()
                self._collect_teachers(batch, sent)
        if self.reference is not None:
            with timed(timings, "reference"):
                calls = self.reference.dispatch_async("compute_log_probs", view)
                rewards.start()
                batch["ref_log_probs"] = self.reference.collect(calls)["ref_log_probs"]
        elif self.cfg.needs_reference_log_probs():  # LoRA: the reference is the trainer without its adapter
            with timed(timings, "reference"):
                calls = self.actor_train.dispatch_async("compute_log_probs", view, adapter_disabled=True)
                rewards.start()
                batch["ref_log_probs"] = self.actor_train.collect(calls)["ref_log_probs"]
        if self.old_logprobs.source == "trainer":
            with timed(timings, "old_log_probs"):
                calls = self.actor_train.dispatch_async("compute_log_probs", view)
                rewards.start()
                scored = self.actor_train.collect(calls)
                batch["old_log_probs"] = scored["old_log_probs"]
                if "routed_experts" in scored:  # MoE: the experts the old policy chose (replay, volatility)
                    batch["routed_experts"] = scored["routed_experts"]
        else:  # the rollout engine's log-probs are the trainer's (choose_old_logprob_source): no pass
            batch["old_log_probs"] = batch["rollout_log_probs"]

    def _send_to_teachers(self, batch: Batch, view: Batch) -> Dict[str, tuple]:
        """Each teacher's pass over the rows routed to it (every row for one teacher, or one whose
        tag_included is empty): teacher -> (its (B,) rows, their indices, the calls in flight)."""
        from roll_gspo.algorithms.distillation import routed_rows

        cfg, roles = self.cfg, self.cfg.teacher_roles()
        hinted = teacher_view(cfg, self.tokenizer, batch, view)  # opsd: the hinted prompts
        domain_tags = {domain: set(reward.tag_included) for domain, reward in cfg.rewards.items()}
        sent = {}
        for name, cluster in self.teachers.items():
            rows = routed_rows(roles[name].tag_included, batch["domain"], domain_tags)
            if bool(rows.any()):
                index = rows.nonzero().flatten().tolist()
                part = hinted if len(index) == len(batch) else hinted.select(index)
                sent[name] = (rows, index, cluster.dispatch_async("compute_log_probs", part))
        return sent

    def _collect_teachers(self, batch: Batch, sent: Dict[str, tuple]) -> None:
        """The teachers' log-probs as one teacher log-prob and one weight per row
        (roll_gspo.algorithms.distillation.combine_teachers)."""
        import torch

        from roll_gspo.algorithms.distillation import combine_teachers

        cfg, roles = self.cfg, self.cfg.teacher_roles()
        shape = tuple(batch["response_mask"].shape)
        scored = {}
        for name, (rows, index, calls) in sent.items():
            part = self.teachers[name].collect(calls)["teacher_log_probs"]
            full = torch.zeros(shape, dtype=part.dtype)
            full[index] = part
            scored[name] = (full, rows)
        coefs = {name: cfg.opd_kl_coef if role.opd_kl_coef is None else role.opd_kl_coef
                 for name, role in roles.items()}
        batch["teacher_log_probs"], batch["teacher_kl_coef"] = combine_teachers(scored, coefs, shape)

    def _train_and_sync(self, step: int, batch: Batch, timings: Dict[str, float]):
        """Train on the batch and, when due, sync the new weights into the rollout engine (within
        the train call when generation is synchronous; async: once the rollout generated ahead is
        complete). Returns the training metrics and the sync's (`sync/*`, empty without one)."""
        cfg = self.cfg
        sync_due = step % cfg.model_update_frequency == 0
        train_actor = actor_trains(cfg, step)  # PPO: not during critic_warmup
        sync_in_train = sync_due and not self.buffer.depth and train_actor
        with timed(timings, "train"):
            critic_calls = (self.critic.dispatch_async("train_step", critic_view(batch)) if self.critic is not None
                            else None)
            # With a sync due, the ranks send the new weights to the rollout ranks at the end of the
            # same call (one driver round trip less); its own time is the `sync` phase.
            per_rank = self.actor_train.dispatch("train_step", self._view(batch), weight_version=step,
                                                 sync_to=self.actor_infer.workers if sync_in_train else None
                                                 ) if train_actor else None
            critic_metrics = _mean_over_ranks(self.critic.collect(critic_calls)) if critic_calls else {}
        if train_actor:
            self.weights_synced, self.trained_step = False, step
        lost = per_rank[0].pop(RECEIVER_LOST, None) if per_rank else None
        unresponsive = per_rank[0].pop(UNRESPONSIVE_RECEIVERS, ()) if per_rank else ()
        self.response_ratios = {row: figures for rank in per_rank or () for row, figures
                                in rank.pop(RESPONSE_RATIOS, {}).items()}
        self.trainer_gaps = {row: gaps for rank in per_rank or () for row, gaps in rank.pop(TRAINER_GAPS, {}).items()}
        train_metrics, sync_metrics = _split_sync_metrics(per_rank) if per_rank else ({}, {})
        if sync_in_train:
            if lost is None:
                self._synced(step)
            else:  # a rollout rank died or hung during the sync: replaced, then every rank synced again
                timings["train"] -= sync_metrics["sync/seconds"]
                self._replace_lost_receivers(step, lost, unresponsive)
                sync_metrics = self.sync_weights(step)
                timings["train"] += sync_metrics["sync/seconds"]
        train_metrics.update(critic_metrics)
        self._follow_logprob_gap(step, train_metrics.get("rollout/logprob_gap"))
        self.buffer.fill(timings)  # async: the rollout being generated completes before the engine takes new weights
        if sync_due and not sync_in_train:
            sync_metrics = self.sync_weights(version=step)
        if sync_due:
            timings["sync"] = sync_metrics["sync/seconds"]
            timings["train"] -= timings["sync"] if sync_in_train else 0.0
        return train_metrics, sync_metrics

    def _step_metrics(self, step: int, rollout: Rollout, timings: Dict[str, float]) -> Dict[str, float]:
        """Phase times, rollout staleness, where old log-probs came from, and the source's own."""
        step_seconds = sum(timings.values())
        restarts = self.replaceable.budget.metrics([self.replaceable.name]) if self.replaceable is not None else {}
        return {
            **restarts,
            **{f"time/{k}_s": v for k, v in timings.items()}, "time/step_s": step_seconds,
            # Steps between the weights that sampled this rollout and those it trains (step - 1).
            "rollout/staleness": float(step - 1 - min(rollout.weight_versions)),
            "rollout/weight_version": float(min(rollout.weight_versions)),
            "rollout/old_logprobs_from_rollout": float(self.old_logprobs.source == "rollout"),
            **self.source.step_metrics(rollout, step_seconds)}

    def _check_staleness(self, step: int, batch: Batch, bound: int) -> Dict[str, float]:
        """k >= 2: every row's staleness (the trainer's version before this step's update, step - 1,
        minus its oldest token's), refused past the bound (the pools drop such groups: one reaching
        the trainer is a bug); its metrics, and `token_lags` (B, T) for the log-prob gap per lag."""
        import torch

        trainer_version = step - 1
        staleness = [trainer_version - int(v) for v in batch["weight_version"]]
        if max(staleness) > bound or min(staleness) < 0:
            raise RuntimeError(f"step {step}: a sample of staleness {max(staleness)} (weight version "
                               f"{min(batch['weight_version'])}, trainer version {trainer_version}) reached the "
                               f"trainer; async_generation_ratio = {bound} bounds it (not trained)")
        lags = torch.zeros(batch["response_mask"].shape)
        for row, versions in enumerate(batch["token_weight_versions"]):
            lags[row, :len(versions)] = trainer_version - torch.tensor(versions, dtype=torch.float32)
        batch["token_lags"] = lags
        return {"rollout/staleness_mean": sum(staleness) / len(staleness),
                "rollout/staleness_max": float(max(staleness)),
                **{f"rollout/staleness_hist/{j}": float(staleness.count(j)) for j in range(bound + 1)}}

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

    # -- trainer tensors, weight sync ----------------------------------------------------------------
    def _add_sequence_tensors(self, batch: Batch) -> None:
        """The trainer's tensors of a batch of prompts and responses (what a test or benchmark scores)."""
        add_sequence_tensors(batch, self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)

    def _view(self, batch: Batch) -> Batch:
        """Only the tensors the training/reference ranks read (less to serialise), with each row's
        place in the batch (`row_index`: what the ranks' per-response figures are keyed by)."""
        import torch

        if "row_index" not in batch:
            batch["row_index"] = torch.arange(len(batch))
        return view(batch, TRAINER_TENSORS)

    def sync_weights(self, version: Optional[int] = None) -> Dict[str, float]:
        """The trainer's weights (those of pipeline step `version`; None keeps the rollout ranks'
        stamp) into every rollout rank (a rank lost during it: replaced, and the sync made again)."""
        metrics = self.actor_train.execute_all("sync_weights_to", self.actor_infer.workers, version)[0]
        lost, unresponsive = metrics.pop(RECEIVER_LOST, None), metrics.pop(UNRESPONSIVE_RECEIVERS, ())
        if lost is not None:
            self._replace_lost_receivers(version, lost, unresponsive)
            return self.sync_weights(version)
        self._synced(version)
        return metrics

    def _synced(self, version: Optional[int]) -> None:
        """Every rollout rank holds the trainer's current weights, stamped `version` (None: unchanged)."""
        self.weights_synced = True
        self.rollout_version = self.rollout_version if version is None else version

    def _replace_lost_receivers(self, version: Optional[int], lost: str, unresponsive: Sequence[int] = ()) -> None:
        """A weight sync lost a rollout rank (`lost`: why; `unresponsive`: the ranks the sender found
        stopped or hung): the ranks that died or hang are replaced; the caller then syncs every
        rank again (a survivor may hold half a sync)."""
        if self.replaceable is None:
            raise WorkerDiedError(f"a rollout rank was lost during the weight sync ({lost}). The run stops; its "
                                  f"last complete checkpoint is intact (resume with resume_from_checkpoint=auto)")
        if unresponsive:  # the line names the rank as the driver's own probes would
            logger.warning("role actor_infer rank %s is unresponsive (stopped or hung, not dead), in phase %s (%s); "
                           "replacing it", ", ".join(map(str, unresponsive)), phase_of("load_weight_bucket"), lost)
        else:
            logger.warning("weight sync: a rollout rank was lost (%s); replacing it", lost)
        self.resyncing, self.resync_version = True, version  # a new rank takes what every rank takes next
        try:
            replaced = self.replaceable.recover(unresponsive)
        finally:
            self.resyncing = False
        if not replaced:  # every rank alive and answering: nothing a replacement would mend
            raise WorkerDiedError(f"a weight sync failed ({lost}) though every rollout rank answers. The run stops; "
                                  f"its last complete checkpoint is intact (resume with resume_from_checkpoint=auto)")

    def _give_weights(self, rank: int, worker) -> str:
        """A replaced rollout rank's hook: the trainer's current weights, with its peers' stamp while
        they are the same weights (exact), else the trainer's step (during a sync that lost the
        rank: the sync's, which every rank then takes)."""
        if self.resyncing:  # every rank takes these weights next
            version, exact = self.rollout_version if self.resync_version is None else self.resync_version, True
        elif self.weights_synced:  # the peers hold the trainer's weights
            version, exact = self.rollout_version, True
        else:  # the trainer trained since the last sync: its weights are the only copy there is
            version, exact = self.trained_step, False
        metrics = self.actor_train.execute_all("sync_weights_to", [worker], version)[0]
        if RECEIVER_LOST in metrics:
            raise WorkerDiedError(f"role actor_infer rank {rank} was lost again while it took the weights "
                                  f"({metrics[RECEIVER_LOST]})")
        return regeneration_note(version, self.rollout_version, exact)

    # -- checkpoints, the loop ----------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> str:
        """Written to a temporary folder, fsynced, renamed into place (`roll_gspo.lifecycle.checkpoint`)."""
        return write_checkpoint(self.cfg, self.actor_train, step, buffered=self.buffer.batches(),
                                driver_state={**self.source.state_dict(),
                                              "old_logprob_source": self.old_logprobs.source},
                                critic=self.critic, pool_states=self.source.pool_states())

    def _load_checkpoint(self, folder: str) -> None:
        """The trainer's state, the source's and the rollouts generated ahead, from `folder`; the
        rollout engine then holds the trainer's weights."""
        state = restore_trainer(folder, self.actor_train, critic=self.critic, actions=self.resume_actions)
        self.source.load_state_dict(state)
        self.start_step = self.trained_step = int(state["step"])
        self.old_logprobs = resumed_old_logprobs(self.old_logprobs, state, self.start_step)  # where the gap had led
        self.sync_weights(version=self.start_step)  # the rollout engine starts from `pretrain`
        self.buffer.restore(load_buffered(folder))
        self.source.load_pool_states(load_pool_states(folder))  # k >= 2: the partials in flight, before any advance
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
                logger.info("run report: %s (rewritten at each validation and at the end)",
                            os.path.join(cfg.output_dir, REPORT_FILE))
                if cfg.eval_steps and self.start_step == 0:
                    first = self.validate(0)
                    tracker.log(0, first)
                    logger.info(MetricsTracker.console_line(0, cfg.max_steps, first))
                    self._write_report()
                with progress_bar(range(self.start_step + 1, cfg.max_steps + 1), cfg.exp_name) as steps:
                    for step in steps:
                        metrics = self.step(step)
                        validated = cfg.eval_steps and (step % cfg.eval_steps == 0 or step == cfg.max_steps)
                        if validated:
                            metrics.update(self.validate(step))
                        metrics.update(self._flag_stalls(step, metrics))
                        tracker.log(step, metrics)
                        if validated:
                            self._write_report()
                        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                            logger.info(MetricsTracker.console_line(step, cfg.max_steps, metrics))
                        last = metrics
                        if checkpoint_due(cfg, step, stop):
                            folder = self.save_checkpoint(step)
                        self.drift.stop_if_breached(step, self._write_report)  # the stop gap: DriftStop
                        if stop.requested and step < cfg.max_steps:
                            self.stopped_by = stop.requested
                            announce_stop(stop.requested, step, cfg.max_steps, folder)
                            break
            if self.stopped_by is None:
                save_final_model(cfg, self.actor_train)
        finally:
            tracker.close()
        plot_metrics(tracker.path, os.path.join(cfg.output_dir, "metrics.png"), cfg.exp_name)
        self._write_report()
        return last

    def _flag_stalls(self, step: int, metrics: Dict[str, float]) -> Dict[str, float]:
        """One console line per stall of this step (roll_gspo.metrics.stalls); its `stall/*` metrics."""
        stalls = self.stalls.observe(step, metrics)
        for stall in stalls:
            logger.warning(stall.line())
        return self.stalls.metrics(stalls)

    def _write_report(self) -> None:
        """The run report (roll_gspo.report) from the files so far; a report that fails to write
        is one warning, never the run's end."""
        try:
            write_report(self.cfg.output_dir, train_dir=self.cfg.rollout_dump_dir, val_dir=self.cfg.validation_data_dir)
        except Exception as exc:  # noqa: BLE001 - the run's training matters more than its page
            logger.warning("run report not written: %s: %s", type(exc).__name__, exc)

    def validate(self, step: int) -> Dict[str, float]:
        """The source's validation at `step`, its samples written to validation_data_dir."""
        metrics = self.source.validate(step)
        metrics.update(self.rollout_files.write("val", step, self.source.validation_records))
        return metrics

    def shutdown(self) -> None:
        """The rollout endpoint, every cluster's ranks, then the GPU reservation."""
        stop_endpoint(getattr(self, "endpoint", None))
        clusters = [self.actor_train, self.actor_infer, self.reference, self.critic, *self.teachers.values(),
                    *self.rewards.values()]
        for cluster in clusters:
            if cluster is not None:
                cluster.shutdown()
        if self.placement is not None:
            self.placement.shutdown()


def run_loop(cfg: PipelineConfig, make_source: MakeSource) -> Dict[str, float]:
    """Train on the rollouts of the source `make_source` builds for the run's plan until max_steps (or
    a stop signal); the last step's metrics."""
    loop = TrainerLoop(cfg, make_source)
    try:
        return loop.run()
    finally:
        loop.shutdown()


def _roles_with_models(cfg: PipelineConfig) -> List[str]:
    """The roles whose models the run loads (built-in models are built first)."""
    return (["actor_train", "actor_infer", "reference"] + (["critic"] if cfg.uses_critic() else [])
            + (["teacher"] if cfg.uses_teacher() and cfg.teacher is not None else []))


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
