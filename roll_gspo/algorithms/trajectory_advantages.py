"""Advantages of multi-turn episodes (the agentic pipeline).

An episode's rewards come from its environment, one per turn. Two ways to credit them, ROLL's:

* trajectory-wise (`grpo`, `reinforce`): the episode's reward is the sum of its step rewards; it
  is normalised over a set of episodes (`reward_normalization.grouping`: the group_size episodes
  of one env seed, a tag, or the batch) and every generated token of the episode gets it. With one
  sequence ratio per episode (`importance_sampling: seq`) this is GSPO on whole trajectories.
* step-wise (`step_reinforce`): turn t's return is G_t = r_t + gamma * G_{t+1}; returns are
  normalised over the turns of a set and each turn's tokens get their own.

Pure torch; shapes in the docstrings.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from .advantages import clip_advantages, whiten
from .losses import masked_mean

NORM_METHODS = ("mean_std", "mean", "identity")


def normalize_in_sets(values: torch.Tensor, set_ids: torch.Tensor, method: str,
                      eps: float = 1e-6) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Normalise `values` within each set.

    values: (M,) float; set_ids: (M,) long, the set of each value. `mean_std`: (x - mean) / std
    (population std; a set whose values are all equal, std <= eps, becomes 0), `mean`: x - mean,
    `identity`: x. Returns ((M,) normalised, metrics with `critic/zero_std_sets`).
    """
    if method not in NORM_METHODS:
        raise ValueError(f"unknown reward normalisation {method!r}; valid: {NORM_METHODS}")
    out = values.to(torch.float64).clone()
    zero_std = 0
    if method != "identity":
        for set_id in torch.unique(set_ids):
            rows = set_ids == set_id
            chunk = out[rows]
            centred = chunk - chunk.mean()
            if method == "mean_std":
                std = chunk.std(unbiased=False)
                if std <= eps:
                    zero_std += 1
                    centred = torch.zeros_like(centred)
                else:
                    centred = centred / std
            out[rows] = centred
    return out.to(values.dtype), {"critic/zero_std_sets": float(zero_std)}


def discounted_turn_returns(step_rewards: Sequence[Sequence[float]], gamma: float) -> List[List[float]]:
    """Per episode, G_t = r_t + gamma * G_{t+1} over its turns."""
    returns = []
    for rewards in step_rewards:
        running, out = 0.0, [0.0] * len(rewards)
        for t in range(len(rewards) - 1, -1, -1):
            running = rewards[t] + gamma * running
            out[t] = running
        returns.append(out)
    return returns


def trajectory_advantages(scores: torch.Tensor, loss_mask: torch.Tensor, set_ids: torch.Tensor, *,
                          method: str, whiten_advantages: bool = False, advantage_clip=None
                          ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Trajectory-wise advantages.

    scores: (N,) episode rewards; loss_mask: (N, T), 1 on generated tokens; set_ids: (N,) long.
    Returns ((N, T) advantages, 0 outside the mask; metrics).
    """
    normed, metrics = normalize_in_sets(scores, set_ids, method)
    advantages = torch.where(loss_mask.bool(), normed[:, None].to(torch.float32), torch.zeros(()))
    return _finish(advantages, loss_mask, scores, whiten_advantages, advantage_clip, metrics)


def step_advantages(turn_returns: Sequence[Sequence[float]], turn_index: torch.Tensor, loss_mask: torch.Tensor,
                    set_ids: torch.Tensor, scores: torch.Tensor, *, method: str, whiten_advantages: bool = False,
                    advantage_clip=None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Step-wise advantages: each generated token gets its turn's normalised return.

    turn_returns: per row, G_t of each turn of its episode (rows of one episode may repeat it);
    turn_index: (N, T) long, the turn of each position (-1 on padding); loss_mask: (N, T);
    set_ids: (N,) long; scores: (N,) episode rewards (metrics only). The returns are normalised over
    all turns of each set (every turn counted once per row). Returns ((N, T), metrics).
    """
    flat, flat_sets, owner = [], [], []
    for row, returns in enumerate(turn_returns):
        for turn, value in enumerate(returns):
            flat.append(value)
            flat_sets.append(int(set_ids[row]))
            owner.append((row, turn))
    normed, metrics = normalize_in_sets(torch.tensor(flat, dtype=torch.float64), torch.tensor(flat_sets), method)
    table = torch.zeros(len(turn_returns), max((len(r) for r in turn_returns), default=0) + 1, dtype=torch.float32)
    for (row, turn), value in zip(owner, normed.tolist()):
        table[row, turn] = value
    index = turn_index.clamp(min=0).clamp(max=table.shape[1] - 1)
    advantages = torch.gather(table, 1, index) * loss_mask * (turn_index >= 0)
    return _finish(advantages, loss_mask, scores, whiten_advantages, advantage_clip, metrics)


def _finish(advantages, loss_mask, scores, whiten_advantages, advantage_clip, metrics):
    if whiten_advantages:
        advantages = whiten(advantages, loss_mask)
    advantages, clip_metrics = clip_advantages(advantages, loss_mask, advantage_clip)
    valid = advantages[loss_mask.bool()]
    metrics = {**metrics, **clip_metrics,
               "critic/score_mean": float(scores.float().mean()) if len(scores) else 0.0,
               "critic/advantages_mean": float(masked_mean(advantages, loss_mask)) if valid.numel() else 0.0,
               "critic/advantages_max": float(valid.max()) if valid.numel() else 0.0,
               "critic/advantages_min": float(valid.min()) if valid.numel() else 0.0}
    return advantages.detach(), metrics
