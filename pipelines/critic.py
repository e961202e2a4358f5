"""PPO's critic in the RLVR step (`adv_estimator: gae`): the values of a step's responses, the GAE
advantages and returns from them, and the critic's update; kept out of the step loop, which calls
these three where GRPO's path computes its advantages and trains."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from roll_gspo.algorithms import RunningMeanStd
from roll_gspo.algorithms.gae import compute_gae_advantages
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.batch_fields import CRITIC_TENSORS, view
from roll_gspo.distributed.cluster import Cluster



def critic_view(batch: Batch) -> Batch:
    """Only the tensors the critic's ranks read."""
    return view(batch, CRITIC_TENSORS)


def start_values(critic: Cluster, batch: Batch):
    """The critic's value passes over `batch`'s responses, started (collect with `collect_values`)."""
    return critic.dispatch_async("compute_values", critic_view(batch))


def collect_values(critic: Cluster, calls) -> torch.Tensor:
    """(B, T) values, 0 past each response."""
    return critic.collect(calls)["values"]


def token_level_kl(cfg: PipelineConfig, batch: Batch) -> Optional[torch.Tensor]:
    """The per-token KL the rewards are penalised with (add_token_level_kl), None when off."""
    return batch["old_log_probs"] - batch["ref_log_probs"] if cfg.add_token_level_kl else None


def gae_advantages_and_returns(cfg: PipelineConfig, batch: Batch,
                               running_stats: Optional[RunningMeanStd]) -> Dict[str, float]:
    """Adds `advantages` and `returns` (B, T) to `batch` (which holds `scores` and the critic's
    `values`): the sequence reward on each response's last token (normalised and clipped as the
    config says), minus init_kl_coef * KL per token with add_token_level_kl, then GAE (gamma, lambd),
    whitening (whiten_advantages) and advantage_clip. Returns the `critic/*` metrics."""
    kl = token_level_kl(cfg, batch)
    advantages, returns, metrics = compute_gae_advantages(
        batch["scores"], batch["values"], batch["response_mask"], group_size=cfg.num_return_sequences_in_group,
        gamma=cfg.gamma, lambd=cfg.lambd, reward_norm=cfg.reward_norm, reward_shift=cfg.reward_shift,
        reward_scale=cfg.reward_scale, reward_clip=cfg.reward_clip, running_stats=running_stats,
        kl=kl, kl_coef=cfg.init_kl_coef if kl is not None else 0.0,
        whiten_advantages=cfg.whiten_advantages, advantage_clip=cfg.advantage_clip)
    batch["advantages"], batch["returns"] = advantages, returns
    return metrics


def actor_trains(cfg: PipelineConfig, step: int) -> bool:
    """Whether the actor updates at (1-based) `step`: after critic_warmup steps of the critic alone
    (ROLL: `critic_warmup <= global_step`, its steps counted from 0)."""
    return not cfg.uses_critic() or step > cfg.critic_warmup
