"""RLVR pipeline (GSPO / GRPO with verifiable rewards).

Each step reads like the algorithm: generate G responses per prompt, reward them, score them
with the reference (when a KL key needs it) and with the trainer (old log-probs), compute
advantages, train ppo_epochs x mini-batches, sync the new weights into the rollout engine.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Dict, List

import ray
import torch

from roll_gspo.algorithms import RunningMeanStd, compute_advantages
from roll_gspo.checkpoint import finish_checkpoint, new_checkpoint_dir, read_state, resolve_resume
from roll_gspo.config import PipelineConfig, mini_batch_size, needs_reference
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster, init_ray
from roll_gspo.modeling import build_sequences
from roll_gspo.tracking import MetricsTracker, plot_metrics
from roll_gspo.utils.imports import import_object

from pipelines.common import prepare_models, progress_bar

logger = logging.getLogger("roll_gspo")
TRAINER_TENSORS = ("input_ids", "attention_mask", "prompt_lengths", "response_mask", "old_log_probs",
                   "advantages", "ref_log_probs", "rollout_log_probs", "routed_experts")


class RLVRPipeline:
    def __init__(self, cfg: PipelineConfig):
        from transformers import AutoTokenizer

        from roll_gspo.data import PromptSampler

        self.cfg = cfg
        prepare_models(cfg, ["actor_train", "actor_infer", "reference"])
        self.resume_dir = resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor_train.model_args.model_name_or_path)
        self.domain_of_worker = self._reward_routes()
        self.train_items, stats = self._load_prompts(cfg.actor_train.data_args)
        self.filtered_prompts = stats["filtered_prompts"]
        self.val_items = self._load_prompts(cfg.validation.data_args)[0] if cfg.validation.data_args.file_name else []
        self._check_domains(self.train_items + self.val_items)
        self.sampler = PromptSampler(self.train_items, cfg.rollout_batch_size, seed=cfg.seed,
                                     shuffle=cfg.actor_train.data_args.shuffle)
        self.running_stats = RunningMeanStd() if cfg.reward_norm == "running" else None
        self.start_step = 0
        self._start_workers()

    # -- set-up ------------------------------------------------------------------------------------
    def _load_prompts(self, data):
        from roll_gspo.data import load_prompts

        return load_prompts(
            data.file_name, prompt_key=data.prompt_key, messages_key=data.messages_key, answer_key=data.answer_key,
            domain_key=data.domain_key, default_domain=next(iter(self.cfg.rewards)), tokenizer=self.tokenizer,
            max_prompt_length=self.cfg.prompt_length, max_samples=data.max_samples)

    def _reward_routes(self) -> Dict[str, str]:
        """data domain -> reward block that scores it (`tag_included`, else the block's key)."""
        routes = {}
        for name, reward in self.cfg.rewards.items():
            for domain in reward.tag_included or [name]:
                routes[domain] = name
        return routes

    def _check_domains(self, items: List[dict]) -> None:
        unknown = sorted({item["domain"] for item in items} - set(self.domain_of_worker))
        if unknown:
            raise ValueError(f"data rows have domains {unknown} that no `rewards` block scores; reward "
                             f"domains: {sorted(self.domain_of_worker)} (add a block or `tag_included`)")

    def _start_workers(self) -> None:
        from roll_gspo.workers.actor_infer import ActorInferWorker
        from roll_gspo.workers.actor_train import ActorTrainWorker
        from roll_gspo.workers.reference import ReferenceWorker

        cfg = self.cfg
        roles = [cfg.actor_train, cfg.actor_infer] + ([cfg.reference] if needs_reference(cfg) else [])
        cpus = sum(r.world_size * r.num_cpus_per_worker for r in roles)
        cpus += sum(r.world_size * r.num_cpus_per_worker for r in cfg.rewards.values())
        gpus = sum(r.world_size * r.num_gpus_per_worker for r in roles)
        init_ray(cpus, gpus)
        batch = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
        total_optimizer_steps = cfg.max_steps * cfg.ppo_epochs * (batch // mini_batch_size(cfg))

        def cluster(name, worker_cls, role, **kwargs):
            return Cluster(name, worker_cls, role.world_size, role.num_cpus_per_worker, role.num_gpus_per_worker,
                           init_args=(cfg,), init_kwargs=kwargs)

        self.actor_train = cluster("actor_train", ActorTrainWorker, cfg.actor_train,
                                   total_optimizer_steps=total_optimizer_steps)
        self.actor_infer = cluster("actor_infer", ActorInferWorker, cfg.actor_infer)
        self.reference = cluster("reference", ReferenceWorker, cfg.reference) if needs_reference(cfg) else None
        self.rewards = {
            name: Cluster(f"reward_{name}", import_object(reward.worker_cls), reward.world_size,
                          reward.num_cpus_per_worker, 0, init_args=(reward,), init_kwargs={"domain": name})
            for name, reward in cfg.rewards.items()}
        clusters = [self.actor_train, self.actor_infer, *([self.reference] if self.reference else []),
                    *self.rewards.values()]
        start = time.perf_counter()
        ray.get([ref for c in clusters for ref in c.setup_async()])  # all roles load in parallel
        logger.info("workers ready in %.1f s", time.perf_counter() - start)
        if self.resume_dir:
            self._load_checkpoint(self.resume_dir)

    # -- one step -----------------------------------------------------------------------------------
    def step(self, step: int) -> Dict[str, float]:
        cfg = self.cfg
        timings: Dict[str, float] = {}
        prompts = self._prompt_batch(self.sampler.next_batch())
        with _timed(timings, "generate"):
            batch = self.actor_infer.dispatch("generate", prompts, gen=cfg.actor_infer.generating_args)
        self._add_sequence_tensors(batch)
        view = self._view(batch)
        pending_rewards = None  # the CPU reward workers score while the first log-prob pass runs
        if self.reference is not None:
            with _timed(timings, "reference"):
                calls = self.reference.dispatch_async("compute_log_probs", view)
                pending_rewards = self._start_rewards(batch)
                batch["ref_log_probs"] = self.reference.collect(calls)["ref_log_probs"]
        with _timed(timings, "old_log_probs"):
            calls = (self.actor_train.dispatch_async("compute_log_probs", view)
                     if cfg.old_logprob_source == "trainer" else None)
            if pending_rewards is None:
                pending_rewards = self._start_rewards(batch)
            if calls is not None:
                scored = self.actor_train.collect(calls)
                batch["old_log_probs"] = scored["old_log_probs"]
                if "routed_experts" in scored:  # MoE: the experts the old policy chose (replay, volatility)
                    batch["routed_experts"] = scored["routed_experts"]
            else:
                batch["old_log_probs"] = batch["rollout_log_probs"]
        with _timed(timings, "reward"):  # what is left of scoring once the log-prob passes are done
            reward_metrics = self._collect_rewards(batch, pending_rewards)
        with _timed(timings, "advantages"):
            batch["advantages"], adv_metrics = self._advantages(batch)
        sync_due = step % cfg.model_update_frequency == 0
        with _timed(timings, "train"):
            # With a sync due, the ranks send the new weights to the rollout ranks at the end of the
            # same call (one driver round trip less); its own time is the `sync` phase.
            per_rank = self.actor_train.dispatch("train_step", self._view(batch),
                                                 sync_to=self.actor_infer.workers if sync_due else None)
        train_metrics, sync_metrics = _split_sync_metrics(per_rank)
        if sync_due:
            timings["sync"] = sync_metrics["sync/seconds"]
            timings["train"] -= timings["sync"]
        step_seconds = sum(timings.values())
        lengths = batch["response_mask"].sum(-1)
        return {
            **reward_metrics, **adv_metrics, **train_metrics, **sync_metrics,
            **{f"time/{k}_s": v for k, v in timings.items()}, "time/step_s": step_seconds,
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/truncated_frac": 1.0 - sum(batch["finished"]) / len(batch),
            "throughput/tokens_per_s": float(lengths.sum()) / max(step_seconds, 1e-9),
            "data/epoch": float(self.sampler.epoch), "data/filtered_prompts": float(self.filtered_prompts),
        }

    def _prompt_batch(self, items: List[dict]) -> Batch:
        keys = ("prompt_ids", "prompt_text", "ground_truth", "domain")
        return Batch(meta={k: [item[k] for item in items] for k in keys})

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

    def _collect_rewards(self, batch: Batch, pending: list) -> Dict[str, float]:
        """Wait for the scores; adds tensor `scores` to the batch and returns reward metrics."""
        scores = torch.zeros(len(batch))
        statuses = [""] * len(batch)
        for rows, refs in pending:
            result = Batch.concat(ray.get(refs))
            scores[rows] = result["scores"]
            for i, status in zip(rows, result["reward_status"]):
                statuses[i] = status
        batch["scores"] = scores
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                "reward/errors": float(statuses.count("error")), "reward/timeouts": float(statuses.count("timeout"))}

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
        kl = None
        if cfg.add_token_level_kl:
            kl = batch["old_log_probs"] - batch["ref_log_probs"]
        return compute_advantages(
            batch["scores"], batch["response_mask"], group_size=cfg.num_return_sequences_in_group,
            adv_estimator=cfg.adv_estimator, reward_norm=cfg.reward_norm, reward_shift=cfg.reward_shift,
            reward_scale=cfg.reward_scale, reward_clip=cfg.reward_clip, running_stats=self.running_stats,
            kl=kl, kl_coef=cfg.init_kl_coef if kl is not None else 0.0,
            whiten_advantages=cfg.whiten_advantages, advantage_clip=cfg.advantage_clip)

    def sync_weights(self) -> Dict[str, float]:
        results = self.actor_train.execute_all("sync_weights_to", self.actor_infer.workers)
        return results[0]

    # -- validation, checkpoints, the loop ------------------------------------------------------------
    def validate(self) -> Dict[str, float]:
        if not self.val_items:
            return {}
        start = time.perf_counter()
        prompts = self._prompt_batch(self.val_items)
        batch = self.actor_infer.dispatch("generate", prompts, gen=self.cfg.validation.generating_args)
        self._collect_rewards(batch, self._start_rewards(batch))
        return {"val/accuracy": float(batch["scores"].mean()), "val/samples": float(len(batch)),
                "time/validation_s": time.perf_counter() - start}

    def save_checkpoint(self, step: int) -> None:
        folder = new_checkpoint_dir(self.cfg.output_dir, step)
        self.actor_train.execute_all("save_checkpoint", folder)
        state = {"step": step, "sampler": self.sampler.state_dict(),
                 "running_stats": self.running_stats.state_dict() if self.running_stats else None}
        finish_checkpoint(folder, state, self.cfg.output_dir, self.cfg.save_total_limit)

    def _load_checkpoint(self, folder: str) -> None:
        state = read_state(folder)
        self.actor_train.execute_all("load_checkpoint", folder)
        self.sampler.load_state_dict(state["sampler"])
        if self.running_stats is not None and state.get("running_stats"):
            self.running_stats.load_state_dict(state["running_stats"])
        self.start_step = int(state["step"])
        self.sync_weights()  # the rollout engine starts from `pretrain`
        logger.info("resumed from %s at step %d", folder, self.start_step)

    def run(self) -> Dict[str, float]:
        cfg = self.cfg
        tracker = MetricsTracker(cfg.output_dir, cfg.logging_dir, cfg.track_with, cfg.tracker_kwargs,
                                 resume=self.resume_dir is not None)
        last: Dict[str, float] = {}
        try:
            if cfg.eval_steps and self.start_step == 0:
                first = self.validate()
                tracker.log(0, first)
                logger.info(MetricsTracker.console_line(0, cfg.max_steps, first))
            with progress_bar(range(self.start_step + 1, cfg.max_steps + 1), cfg.exp_name) as steps:
                for step in steps:
                    metrics = self.step(step)
                    if cfg.eval_steps and (step % cfg.eval_steps == 0 or step == cfg.max_steps):
                        metrics.update(self.validate())
                    tracker.log(step, metrics)
                    if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                        logger.info(MetricsTracker.console_line(step, cfg.max_steps, metrics))
                    if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps:
                        self.save_checkpoint(step)
                    last = metrics
            final_dir = os.path.join(cfg.output_dir, "final_model")
            self.actor_train.execute_all("save_hf_model", final_dir)
            logger.info("final model (Hugging Face format): %s", final_dir)
        finally:
            tracker.close()
        plot_metrics(tracker.path, os.path.join(cfg.output_dir, "metrics.png"), cfg.exp_name)
        return last

    def shutdown(self) -> None:
        clusters = [self.actor_train, self.actor_infer, self.reference, *self.rewards.values()]
        for cluster in clusters:
            if cluster is not None:
                cluster.shutdown()


@contextmanager
def _timed(timings: Dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


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
