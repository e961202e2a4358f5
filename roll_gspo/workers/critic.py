"""`critic` role (PPO, `adv_estimator: gae`): training-engine ranks (DeepSpeed ZeRO or torch FSDP2,
the critic's own `strategy_name`) holding the value model, the policy's body with a scalar head
(roll_gspo.models.value_model). They score responses (`compute_values`: the values GAE needs) and
fit the values to the GAE returns (`train_step`: PPO's clipped value loss, ppo_epochs x
mini-batches of the critic's own training_args, one optimizer step per mini-batch, normalised over
the whole mini-batch across ranks and micro-batches, as the actor)."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List

import torch

from roll_gspo.algorithms.gae import value_loss
from roll_gspo.schema.config import PipelineConfig, RoleConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import HealthProbed, RankWorker
from roll_gspo.distributed.micro_batching import MicroBatch, ppo_mini_batches, role_micro_batches, scatter_rows, take
from roll_gspo.lifecycle.seeding import trainer_seed
from roll_gspo.models.value_model import response_values, value_padding_pass
from roll_gspo.workers.actor_train import NonFiniteLossError, train_strategy_class
from roll_gspo.workers.train_metrics import SplitInvariantMetrics

# Inside a checkpoint folder: the critic's engine state, beside the actor's.
CHECKPOINT_SUBDIR = "critic"


def batch_values(engine, batch: Batch) -> torch.Tensor:
    """(B, T) values of `batch`'s responses (T = its response_mask width) under `engine`."""
    return response_values(engine, batch["input_ids"], batch["attention_mask"], batch["prompt_lengths"],
                           batch["response_mask"].shape[1])


class CriticWorker(HealthProbed, RankWorker):
    def __init__(self, cfg: PipelineConfig, *, dist_env: Dict[str, Any], total_optimizer_steps: int):
        super().__init__(dist_env)
        self.cfg = cfg
        self.role: RoleConfig = cfg.critic
        self.total_optimizer_steps = total_optimizer_steps

    def setup(self) -> None:
        strategy_class = train_strategy_class(self.role.strategy_args.strategy_name)
        self.strategy = strategy_class(self.role, train=True, total_optimizer_steps=self.total_optimizer_steps,
                                       seed=self.cfg.seed, value_model=True)
        self.engine = self.strategy.engine

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """Values of this rank's shard (`values`, (B, T), 0 past each response), in micro-batches of
        `infer_batch_size` rows (or by token budget), as many passes as the busiest rank where a
        forward pass is collective (ZeRO-3, FSDP2 over several ranks)."""
        plans = role_micro_batches(batch, self.role, "infer")
        passes = self.strategy.scoring_passes(len(plans))
        width = batch["response_mask"].shape[1] if len(batch) else 0
        self.engine.eval()
        try:
            parts = [batch_values(self.engine, take(batch, plan)) for plan in plans]
            for _ in range(max(0, (passes or 0) - len(plans))):
                value_padding_pass(self.engine)
        finally:
            self.engine.train()
        values = scatter_rows(parts, plans, len(batch), width)
        return Batch({"values": values * batch["response_mask"].to(values.dtype) if len(batch) else values})

    def train_step(self, batch: Batch) -> Dict[str, float]:
        """Value-function update on this rank's shard. Needs input_ids, attention_mask,
        prompt_lengths, response_mask, values (the critic's before the update: value_clip's
        anchor) and returns (GAE's targets). Returns `critic/*` metrics over all ranks."""
        cfg = self.cfg
        metrics = SplitInvariantMetrics()
        # Mini-batch order is a function of the optimizer step, which checkpoints restore.
        generator = torch.Generator().manual_seed(cfg.seed + 1 + self.strategy.global_steps)
        torch.manual_seed(trainer_seed(cfg.seed + 1, self.strategy.global_steps, self.rank))
        mini_batches = ppo_mini_batches(batch, self.role, cfg.ppo_epochs, generator)
        passes = self.strategy.max_over_ranks([len(plans) for _, plans in mini_batches])
        for (mini, plans), count in zip(mini_batches, passes):
            self._train_mini_batch(mini, plans, count, metrics)
        return metrics.reduce(self.strategy.all_reduce_sum)

    def _train_mini_batch(self, mini: Batch, plans: List[MicroBatch], passes: int,
                          metrics: SplitInvariantMetrics) -> None:
        """One optimizer step: a forward/backward per micro-batch of `plans`, then padding passes
        up to `passes` (every pass is collective under ZeRO-2/3 and FSDP2)."""
        cfg = self.cfg
        # Every response token's value is fitted, also of responses the actor's loss masks out
        # (max_len_mask, difficulty_mask): their returns are still valid targets.
        mask = mini["response_mask"]
        num_seqs, num_tokens = self.strategy.all_reduce_sum([float((mask.sum(-1) > 0).sum()), float(mask.sum())])
        for index, plan in enumerate(plans):
            micro = take(mini, plan)
            micro_mask = micro["response_mask"]
            values = batch_values(self.engine, micro)
            loss, loss_metrics = value_loss(values, micro["values"], micro["returns"], micro_mask,
                                            value_clip=cfg.value_clip, loss_agg_mode=cfg.loss_agg_mode,
                                            num_seqs=num_seqs, num_tokens=num_tokens,
                                            norm_length=cfg.loss_norm_length)
            if not math.isfinite(float(loss.detach())):
                raise NonFiniteLossError(
                    f"non-finite critic loss at optimizer step {self.strategy.global_steps} {loss_metrics}; the "
                    f"critic was not updated. Check rewards for NaN, or lower critic.training_args.learning_rate")
            self.strategy.backward_and_step(loss, boundary=index == passes - 1)
            metrics.add_micro(loss_metrics, float(micro_mask.sum()))
        for index in range(len(plans), passes):
            self.strategy.backward_and_step(value_padding_pass(self.engine).sum() * 0.0, boundary=index == passes - 1)
        metrics.end_mini_batch()
        metrics.add_step({"critic/grad_norm": self.strategy.grad_norm(), "critic/lr": self.strategy.learning_rate()})

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, folder: str) -> None:
        self.strategy.save_checkpoint(os.path.join(folder, CHECKPOINT_SUBDIR))

    def load_checkpoint(self, folder: str, mode: str = "native") -> None:
        path = os.path.join(folder, CHECKPOINT_SUBDIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint {folder} holds no critic ({CHECKPOINT_SUBDIR}/): it was written by a "
                                    f"run without adv_estimator: gae, which cannot resume as PPO")
        self.strategy.load_checkpoint(path, mode)

    def optimizer_steps(self) -> int:
        return self.strategy.global_steps
