"""`reference` role: the frozen initial policy, scoring responses for the KL terms. Started only
when `use_kl_loss` or `add_token_level_kl` needs it."""
from __future__ import annotations

from typing import Any, Dict

import torch

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import HealthProbed, RankWorker
from roll_gspo.distributed.micro_batching import role_micro_batches
from roll_gspo.models.causal_lm import score_micro_batches


class ReferenceWorker(HealthProbed, RankWorker):
    ROLE = "reference"  # the config block the rank loads (the teacher role reuses this worker)
    OUTPUT = "ref_log_probs"  # the batch field its pass fills

    def __init__(self, cfg: PipelineConfig, *, dist_env: Dict[str, Any]):
        super().__init__(dist_env)
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        role = self.role_block()
        self.role = role
        self.temperature = cfg.actor_infer.generating_args.temperature or 1.0
        if role.strategy_args.engine.train_engine:
            from roll_gspo.workers.actor_train import train_strategy_class

            # A frozen training engine: ZeRO-3 or FSDP2 can shard it.
            self.strategy = train_strategy_class(role.strategy_args.strategy_name)(role, train=False, seed=cfg.seed)
            self.model = self.strategy.engine
        else:
            from roll_gspo.models.causal_lm import load_causal_lm

            self.strategy = None
            self.model = load_causal_lm(role.model_args.model_name_or_path, role.model_args.dtype).eval()

    def role_block(self):
        """The config block this rank loads."""
        return getattr(self.cfg, self.ROLE)

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch) -> Batch:
        """Reference log-probs of this rank's shard, in micro-batches of `infer_batch_size` rows
        (or by token budget: `use_dynamic_batching_in_infer`). Under ZeRO-3 and FSDP2 a forward pass is
        collective: every rank runs as many as the busiest one, so a batch that does not split
        evenly over the ranks cannot deadlock them."""
        plans = role_micro_batches(batch, self.role, "infer")
        passes = self.strategy.scoring_passes(len(plans)) if self.strategy is not None else None
        log_probs = score_micro_batches(self.model, batch, plans, self.temperature, passes)
        return Batch({self.OUTPUT: log_probs})
