"""`actor_train` role: DeepSpeed ranks that score responses (old log-probs) and run the GSPO
update: ppo_epochs x mini-batches, one optimizer step per mini-batch, with the loss normalisers of
the whole mini-batch across ranks and micro-batches."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

from roll_gspo.algorithms import kl_loss, policy_loss
from roll_gspo.config.schema import PipelineConfig, RoleConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import RankWorker
from roll_gspo.modeling import micro_batches, response_token_log_probs
from roll_gspo.weight_sync import WeightSender, broadcast_weights


class NonFiniteLossError(RuntimeError):
    """A loss became NaN/inf; raised before the bad gradient reaches the weights."""


def forward_log_probs(engine, batch: Batch, temperature: float, with_entropy: bool = False):
    """(B, T) log-probs of batch's responses under `engine` (T = batch response_mask width)."""
    return response_token_log_probs(engine, batch["input_ids"], batch["attention_mask"], batch["prompt_lengths"],
                                    batch["response_mask"].shape[1], temperature, with_entropy)


class ActorTrainWorker(RankWorker):
    def __init__(self, cfg: PipelineConfig, *, dist_env: Dict[str, Any], total_optimizer_steps: int,
                 role_name: str = "actor_train"):
        super().__init__(dist_env)
        self.cfg = cfg
        self.role: RoleConfig = getattr(cfg, role_name)
        self.total_optimizer_steps = total_optimizer_steps
        self.temperature = cfg.actor_infer.generating_args.temperature or 1.0
        self.weight_sender = None

    def setup(self) -> None:
        from roll_gspo.strategies.deepspeed_strategy import DeepSpeedStrategy

        self.strategy = DeepSpeedStrategy(self.role, train=True, total_optimizer_steps=self.total_optimizer_steps,
                                          seed=self.cfg.seed)
        self.engine = self.strategy.engine

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch) -> Batch:
        """Old log-probs of this rank's shard, in micro-batches of `infer_batch_size`."""
        self.engine.eval()
        parts = []
        for chunk in micro_batches(len(batch), self.role.infer_batch_size):
            log_probs, _ = forward_log_probs(self.engine, batch.select(range(chunk.start, chunk.stop)),
                                             self.temperature)
            parts.append(log_probs)
        self.engine.train()
        return Batch({"old_log_probs": torch.cat(parts)})

    def train_step(self, batch: Batch, sync_to: Optional[List[Any]] = None) -> Dict[str, float]:
        """GSPO update on this rank's shard. Needs tensors input_ids, attention_mask,
        prompt_lengths, response_mask, old_log_probs, advantages (and ref_log_probs with
        use_kl_loss). Returns metrics averaged over micro-batches; with `sync_to` (the rollout
        workers), the new weights are then sent to them and the `sync/*` metrics added."""
        cfg, args = self.cfg, self.role.training_args
        per_rank_mini = args.per_device_train_batch_size * args.gradient_accumulation_steps
        metrics: Dict[str, List[float]] = defaultdict(list)
        generator = torch.Generator().manual_seed(cfg.seed + int(self.engine.global_steps))
        first = True
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator).tolist()
            for start in range(0, len(batch), per_rank_mini):
                mini = batch.select(order[start:start + per_rank_mini])
                self._train_mini_batch(mini, metrics, before_any_update=first)
                first = False
        result = {k: float(sum(v) / len(v)) for k, v in metrics.items()}
        if sync_to is not None:
            result.update(self.sync_weights_to(sync_to))
        return result

    def _train_mini_batch(self, mini: Batch, metrics: Dict[str, List[float]], before_any_update: bool) -> None:
        cfg, args = self.cfg, self.role.training_args
        mask = mini["response_mask"]
        # Normalisers of the whole mini-batch over all ranks, so the gradient does not depend on
        # the number of ranks or micro-batches.
        num_seqs, num_tokens = self.strategy.all_reduce_sum(
            [float((mask.sum(-1) > 0).sum()), float(mask.sum())])
        for chunk in micro_batches(len(mini), args.per_device_train_batch_size):
            micro = mini.select(range(chunk.start, chunk.stop))
            micro_mask = micro["response_mask"]
            log_probs, entropy = forward_log_probs(self.engine, micro, self.temperature, with_entropy=True)
            loss, pg_metrics = policy_loss(
                log_probs, micro["old_log_probs"], micro["advantages"], micro_mask,
                importance_sampling=cfg.importance_sampling, clip_low=cfg.pg_clip_low, clip_high=cfg.pg_clip_high,
                loss_agg_mode=cfg.loss_agg_mode, dual_clip_c=cfg.dual_clip_c if cfg.dual_clip_loss else None,
                num_seqs=num_seqs, num_tokens=num_tokens, norm_length=cfg.loss_norm_length)
            if cfg.use_kl_loss:
                kl_value, kl_metrics = kl_loss(log_probs, micro["ref_log_probs"], micro_mask,
                                               estimator=cfg.kl_estimator, loss_agg_mode=cfg.loss_agg_mode,
                                               num_seqs=num_seqs, num_tokens=num_tokens,
                                               norm_length=cfg.loss_norm_length)
                loss = loss + cfg.kl_loss_coef * kl_value
                pg_metrics = {**pg_metrics, **kl_metrics}
            if before_any_update and "rollout_log_probs" in micro:
                # Trainer vs rollout engine on the same, not yet updated, policy.
                gap = (log_probs.detach() - micro["rollout_log_probs"]).abs()
                metrics["rollout/logprob_gap"].append(float((gap * micro_mask).sum() / micro_mask.sum().clamp(min=1)))
            self._check_finite(loss, pg_metrics)
            self.strategy.backward_and_step(loss)
            for key, value in pg_metrics.items():
                metrics[key].append(value)
            token_count = float(micro_mask.sum())
            if token_count:
                metrics["actor/entropy"].append(float((entropy * micro_mask).sum() / token_count))
        metrics["actor/grad_norm"].append(self.strategy.grad_norm())
        metrics["actor/lr"].append(self.strategy.learning_rate())

    def _check_finite(self, loss: torch.Tensor, details: Dict[str, float]) -> None:
        """Raise before a NaN/inf gradient exists. The other ranks then wait in their next
        collective; the driver sees this rank fail and stops them all (`Cluster` gathers fail-fast),
        which costs nothing per micro-batch, unlike agreeing on it with an all-reduce."""
        if not math.isfinite(float(loss.detach())):
            raise NonFiniteLossError(
                f"non-finite loss at optimizer step {int(self.engine.global_steps)} {details}; the weights "
                f"were not updated and saved checkpoints are intact. Check rewards and advantages for "
                f"NaN, or lower actor_train.training_args.learning_rate")

    def sft_step(self, batch: Batch) -> Dict[str, float]:
        """One pass of supervised fine-tuning over this rank's shard: token-mean cross-entropy on
        the response tokens (response_mask), normalised over the mini-batch across ranks."""
        args = self.role.training_args
        per_rank_mini = args.per_device_train_batch_size * args.gradient_accumulation_steps
        metrics: Dict[str, List[float]] = defaultdict(list)
        for start in range(0, len(batch), per_rank_mini):
            mini = batch.select(range(start, min(start + per_rank_mini, len(batch))))
            (num_tokens,) = self.strategy.all_reduce_sum([float(mini["response_mask"].sum())])
            for chunk in micro_batches(len(mini), args.per_device_train_batch_size):
                micro = mini.select(range(chunk.start, chunk.stop))
                log_probs, _ = forward_log_probs(self.engine, micro, 1.0)
                mask = micro["response_mask"]
                loss = -(log_probs * mask).sum() / max(num_tokens, 1.0)
                self._check_finite(loss, {})
                self.strategy.backward_and_step(loss)
                metrics["sft/loss"].append(float(-(log_probs.detach() * mask).sum() / mask.sum().clamp(min=1)))
                correct = (log_probs.detach().exp() > 0.5).float()
                metrics["sft/token_acc"].append(float((correct * mask).sum() / mask.sum().clamp(min=1)))
            metrics["actor/grad_norm"].append(self.strategy.grad_norm())
            metrics["actor/lr"].append(self.strategy.learning_rate())
        return {k: float(sum(v) / len(v)) for k, v in metrics.items()}

    # -- weights and checkpoints ---------------------------------------------------------------
    def sync_weights_to(self, receivers: List[Any]) -> Dict[str, float]:
        bucket_bytes = int(self.cfg.weight_sync_bucket_mb * (1 << 20))
        if self.rank == 0 and self.weight_sender is None:  # the rollout ranks are fixed for the run
            self.weight_sender = WeightSender(receivers, self.cfg.weight_sync_transport, bucket_bytes,
                                              self.cfg.weight_sync_timeout_s)
        return broadcast_weights(self.strategy, bucket_bytes, self.weight_sender)

    def save_checkpoint(self, folder: str) -> None:
        self.strategy.save_checkpoint(folder)

    def load_checkpoint(self, folder: str) -> None:
        self.strategy.load_checkpoint(folder)

    def save_hf_model(self, folder: str) -> None:
        self.strategy.save_hf_model(folder, self.role.model_args.model_name_or_path)

    def optimizer_steps(self) -> int:
        return int(self.engine.global_steps)
