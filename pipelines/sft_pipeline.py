"""SFT pipeline: supervised fine-tuning on (prompt, response) rows with the same YAML/CLI and the
same DeepSpeed `actor_train` ranks as RL. Also how `builtin:tiny-arith` gets its warm start."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from typing import Dict, List

import ray

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster, init_ray, worker_env
from roll_gspo.placement.device_mapping import GpuPlacement, plan_for_roles, resource_totals
from roll_gspo.models.causal_lm import build_sequences
from roll_gspo.metrics.recorder import MetricsTracker

from pipelines.common import prepare_models, progress_bar

logger = logging.getLogger("roll_gspo")
MINI_BATCHES_PER_CALL = 8  # mini-batches per dispatch: fewer round trips, a progress tick each


def _to_batch(samples: List[dict], pad_id: int) -> Batch:
    prompts, responses = [], []
    for sample in samples:
        split = sum(1 for label in sample["labels"] if label == -100)
        prompts.append(sample["input_ids"][:split])
        responses.append(sample["input_ids"][split:])
    input_ids, attention, prompt_lengths, response_mask = build_sequences(prompts, responses, pad_id)
    return Batch({"input_ids": input_ids, "attention_mask": attention, "prompt_lengths": prompt_lengths,
                  "response_mask": response_mask})


def greedy_accuracy(model_dir: str, files: List[str], max_new_tokens: int, limit: int = 256) -> float:
    """Exact-match accuracy of greedy answers on (prompt, ground_truth) rows, with transformers."""
    from transformers import AutoTokenizer

    from roll_gspo.schema.config import GeneratingArgs, RoleConfig
    from roll_gspo.data.prompts import load_prompts
    from roll_gspo.rewards import math_verify_reward
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

    role = RoleConfig(infer_batch_size=256)
    role.model_args.model_name_or_path = model_dir
    strategy = HfInferStrategy(role, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items, _ = load_prompts(files, default_domain="math_rule", tokenizer=tokenizer, max_prompt_length=1 << 30,
                            max_samples=limit)
    samples = strategy.generate([i["prompt_ids"] for i in items], GeneratingArgs(max_new_tokens=max_new_tokens,
                                                                                  temperature=0.0), 1)
    texts = tokenizer.batch_decode([s[0][0] for s in samples], skip_special_tokens=True)
    return sum(math_verify_reward(i["prompt_text"], t, i["ground_truth"]) for i, t in zip(items, texts)) / len(items)


def run_sft(cfg: PipelineConfig) -> Dict[str, float]:
    from transformers import AutoTokenizer

    from roll_gspo.data.prompts import load_sft_samples
    from roll_gspo.workers.actor_train import ActorTrainWorker

    cfg = prepare_models(cfg, ["actor_train"])
    role, data = cfg.actor_train, cfg.actor_train.data_args
    tokenizer = AutoTokenizer.from_pretrained(role.model_args.model_name_or_path)
    samples = load_sft_samples(data.file_name, tokenizer=tokenizer, prompt_key=data.prompt_key,
                               response_key=data.response_key, messages_key=data.messages_key,
                               max_length=cfg.prompt_length + cfg.response_length, max_samples=data.max_samples)
    mini = cfg.mini_batch_size()
    per_epoch = len(samples) // mini  # the last partial mini-batch is dropped (ranks must agree)
    if per_epoch == 0:
        raise ValueError(f"SFT data has {len(samples)} rows, fewer than one mini-batch of {mini}")
    total = per_epoch * role.training_args.num_train_epochs
    started_ray = not ray.is_initialized()
    init_ray(*resource_totals({"actor_train": role}))
    placement = plan_for_roles({"actor_train": role}, cfg.num_gpus_per_node)  # with a device_mapping
    placement = GpuPlacement(placement).reserve() if placement else None
    trainer = Cluster("sft_actor_train", ActorTrainWorker, role.world_size, role.num_cpus_per_worker,
                      role.num_gpus_per_worker, init_args=(cfg,), init_kwargs={"total_optimizer_steps": total},
                      env=worker_env(cfg, role),
                      rank_options=placement.rank_options("actor_train") if placement else None)
    ray.get(trainer.setup_async())
    tracker = MetricsTracker(cfg.output_dir, cfg.logging_dir, cfg.track_with, cfg.tracker_kwargs,
                             exp_name=cfg.exp_name, config=dataclasses.asdict(cfg))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(cfg.seed)
    metrics: Dict[str, float] = {}
    step = 0
    try:
        with progress_bar(range(total), f"{cfg.exp_name} (sft)") as bar:
            for _ in range(role.training_args.num_train_epochs):
                order = list(range(len(samples)))
                if data.shuffle:
                    rng.shuffle(order)
                for start in range(0, per_epoch * mini, mini * MINI_BATCHES_PER_CALL):
                    rows = order[start:min(start + mini * MINI_BATCHES_PER_CALL, per_epoch * mini)]
                    began = time.perf_counter()
                    batch = _to_batch([samples[i] for i in rows], pad_id)
                    # Rank r takes every world_size-th mini-batch slice so each gets whole ones.
                    per_rank = [batch.select([j for j in range(len(batch)) if (j // (mini // role.world_size))
                                              % role.world_size == r]) for r in range(role.world_size)]
                    results = trainer.gather([w.sft_step.remote(s) for w, s in zip(trainer.workers, per_rank)])
                    metrics = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
                    metrics["time/step_s"] = time.perf_counter() - began
                    step += len(rows) // mini
                    tracker.log(step, metrics)
                    bar.update(len(rows) // mini)
                    bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}", token_acc=f"{metrics['sft/token_acc']:.3f}")
        final_dir = os.path.join(cfg.output_dir, "final_model")
        trainer.execute_all("save_hf_model", final_dir)
        logger.info("SFT done: %d optimizer steps, loss %.4f; model in %s", step, metrics.get("sft/loss", float("nan")),
                    final_dir)
    finally:
        tracker.close()
        trainer.shutdown()
        if placement is not None:
            placement.shutdown()
        if started_ray:
            ray.shutdown()
    return metrics
