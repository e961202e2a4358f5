"""`reference` role: the frozen initial policy, scoring responses for the KL terms. Started only
when `use_kl_loss` or `add_token_level_kl` needs it."""
from __future__ import annotations

from typing import Any, Dict

import torch

from roll_gspo.config.schema import PipelineConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import RankWorker
from roll_gspo.modeling import micro_batches, response_token_log_probs


class ReferenceWorker(RankWorker):
    def __init__(self, cfg: PipelineConfig, *, dist_env: Dict[str, Any]):
        super().__init__(dist_env)
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        role = cfg.reference
        self.infer_batch_size = role.infer_batch_size
        self.temperature = cfg.actor_infer.generating_args.temperature or 1.0
        if role.strategy_args.strategy_name in ("deepspeed_infer", "deepspeed_train"):
            from roll_gspo.strategies.deepspeed_strategy import DeepSpeedStrategy

            self.model = DeepSpeedStrategy(role, train=False, seed=cfg.seed).engine  # ZeRO-3 can shard it
        else:
            from roll_gspo.modeling import load_causal_lm

            self.model = load_causal_lm(role.model_args.model_name_or_path, role.model_args.dtype).eval()

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch) -> Batch:
        parts = []
        for chunk in micro_batches(len(batch), self.infer_batch_size):
            micro = batch.select(range(chunk.start, chunk.stop))
            log_probs, _ = response_token_log_probs(self.model, micro["input_ids"], micro["attention_mask"],
                                                    micro["prompt_lengths"], micro["response_mask"].shape[1],
                                                    self.temperature)
            parts.append(log_probs)
        return Batch({"ref_log_probs": torch.cat(parts)})
