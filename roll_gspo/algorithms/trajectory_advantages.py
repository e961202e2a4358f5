"""Advantages of multi-turn episodes (the agentic pipeline), ROLL's chain.

An episode's rewards come from its environment, one per turn. Two ways to credit them, ROLL's:

* trajectory-wise (`grpo`, `reinforce`): the episode's reward is the sum of its step rewards; it
  is normalised over a set of episodes (`reward_normalization.grouping`: the group_size episodes
  of one env seed, a tag, or the batch) and every generated token of the episode gets it.
* step-wise (`step_reinforce`): turn t's return is G_t = r_t + gamma * G_{t+1}; each turn's return
  is one value of its set (a turn sample's own turn, or every turn of a trajectory sample, each
  once) and each turn's tokens get their own normalised return.

Then, as ROLL's `compute_token_reward` and `compute_reinforce_return`: `reward_clip` clamps the
normalised values; with a KL term (`add_token_level_kl`) each generated token's reward is
`-init_kl_coef * (old_logp - ref_logp)`, the value sits on the sample's last generated token, the
token rewards are clamped again, and a token's advantage is the sum of its sample's token rewards
from it on (gamma 1). Without a KL term every token of a turn simply gets its value.

Rows whose episode never started (the env's reset failed) are in no set's statistics and get 0.

Pure torch; shapes in the docstrings.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .advantages import clip_advantages, clip_rewards, whiten
from .losses import masked_mean

NORM_METHODS = ("mean_std", "mean", "identity")


def normalize_in_sets(values: torch.Tensor, set_ids: torch.Tensor, method: str, eps: float = 1e-6,
                      valid: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Normalise `values` within each set.

    values: (M,) float; set_ids: (M,) long, the set of each value; valid: (M,) bool or None (all),
    the values that count (an invalid one is in no statistic and becomes 0). `mean_std`:
    (x - mean) / std (population std; a set whose values are all equal, std <= eps, becomes 0),
    `mean`: x - mean, `identity`: x. Returns ((M,) normalised, metrics with `critic/zero_std_sets`).
    """
    if method not in NORM_METHODS:
        raise ValueError(f"unknown reward normalisation {method!r}; valid: {NORM_METHODS}")
    valid = torch.ones(values.shape, dtype=torch.bool) if valid is None else valid.bool()
    out = torch.where(valid, values.to(torch.float64), torch.zeros((), dtype=torch.float64))
    zero_std = 0
    if method != "identity":
        for set_id in torch.unique(set_ids[valid]):
            rows = (set_ids == set_id) & valid
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
                          method: str, valid: Optional[torch.Tensor] = None, reward_clip: Optional[float] = None,
                          kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0, whiten_advantages: bool = False,
                          advantage_clip=None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Trajectory-wise advantages: one normalised reward per sample.

    scores: (N,) episode rewards; loss_mask: (N, T), 1 on generated tokens; set_ids: (N,) long;
    valid: (N,) bool or None, the rows whose episode started; kl: (N, T) or None (old_logp -
    ref_logp). Returns ((N, T) advantages, 0 outside the mask; metrics).
    """
    normed, metrics = normalize_in_sets(scores, set_ids, method, valid=valid)
    normed, clip_metrics = clip_rewards(normed, reward_clip)
    per_token = torch.where(loss_mask.bool(), normed[:, None].to(torch.float32), torch.zeros(()))
    advantages, token_metrics = _token_credit(per_token, loss_mask, kl, kl_coef, reward_clip)
    return _finish(advantages, loss_mask, scores, whiten_advantages, advantage_clip,
                   {**metrics, **clip_metrics, **token_metrics})


def step_advantages(turn_returns: Sequence[Mapping[int, float]], turn_index: torch.Tensor, loss_mask: torch.Tensor,
                    set_ids: torch.Tensor, scores: torch.Tensor, *, method: str, valid: Optional[torch.Tensor] = None,
                    reward_clip: Optional[float] = None, kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                    whiten_advantages: bool = False, advantage_clip=None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Step-wise advantages: each generated token gets its turn's normalised return.

    turn_returns: per row, {turn: G_t} for the turns the row trains on (a turn sample: its own turn;
    a trajectory sample: all its turns): each entry is one value of the row's set, so a turn counts
    once however many rows share its episode; turn_index: (N, T) long, the turn of each position
    (-1 on padding); loss_mask: (N, T); set_ids: (N,) long; scores: (N,) episode rewards (metrics
    only); valid, kl: as `trajectory_advantages`. Returns ((N, T), metrics).
    """
    valid = torch.ones(len(turn_returns), dtype=torch.bool) if valid is None else valid.bool()
    flat, flat_sets, flat_valid, owner = [], [], [], []
    for row, returns in enumerate(turn_returns):
        for turn, value in sorted(returns.items()):
            flat.append(float(value))
            flat_sets.append(int(set_ids[row]))
            flat_valid.append(bool(valid[row]))
            owner.append((row, turn))
    normed, metrics = normalize_in_sets(torch.tensor(flat, dtype=torch.float64), torch.tensor(flat_sets, dtype=torch.long),
                                        method, valid=torch.tensor(flat_valid, dtype=torch.bool))
    normed, clip_metrics = clip_rewards(normed, reward_clip)
    turns = max((turn for _, turn in owner), default=0) + 1
    table = torch.zeros(len(turn_returns), turns + 1, dtype=torch.float32)  # the last column: turns with no entry
    for (row, turn), value in zip(owner, normed.tolist()):
        table[row, turn] = value
    index = torch.where((turn_index >= 0) & (turn_index < turns), turn_index, torch.full_like(turn_index, turns))
    per_token = torch.gather(table, 1, index) * loss_mask
    advantages, token_metrics = _token_credit(per_token, loss_mask, kl, kl_coef, reward_clip)
    return _finish(advantages, loss_mask, scores, whiten_advantages, advantage_clip,
                   {**metrics, **clip_metrics, **token_metrics})


def _token_credit(per_token: torch.Tensor, loss_mask: torch.Tensor, kl: Optional[torch.Tensor], kl_coef: float,
                  reward_clip: Optional[float]) -> Tuple[torch.Tensor, Dict[str, float]]:
    """ROLL's token rewards and REINFORCE return (gamma 1) over each row's generated tokens.

    per_token: (N, T), each generated token's (normalised, clipped) value, 0 elsewhere; loss_mask,
    kl: (N, T). Token rewards r: `-kl_coef * kl` on generated tokens, plus the value of the row's
    last generated token there; clamped to [-reward_clip, reward_clip]; A_t = sum_{s >= t} r_s +
    (value_t - value_last): a one-turn row (ROLL's case) gets exactly ROLL's return, a row whose
    turns carry different values (step_reinforce on a trajectory) each turn's value plus the KL to go.
    Returns ((N, T), metrics).
    """
    mask = loss_mask.bool()
    if kl is None and reward_clip is None:
        return torch.where(mask, per_token, torch.zeros(())), {}
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(-1).values  # (N,)
    is_last = (positions == last[:, None]) & mask
    value_last = (per_token * is_last).sum(-1, keepdim=True)
    rewards = torch.where(is_last, per_token, torch.zeros(()))
    metrics: Dict[str, float] = {}
    if kl is not None:
        kl = torch.where(mask, kl.to(torch.float32), torch.zeros(()))
        rewards = rewards - kl_coef * kl
        metrics.update({"critic/kl": float(masked_mean(kl, loss_mask)) if mask.any() else 0.0,
                        "critic/kl_coef": float(kl_coef)})
    if reward_clip is not None:
        clipped = rewards.clamp(-reward_clip, reward_clip)
        metrics["critic/token_reward_clipfrac"] = (float(masked_mean((clipped != rewards).float(), loss_mask))
                                                   if mask.any() else 0.0)
        rewards = clipped
    returns = torch.where(mask, rewards, torch.zeros(())).flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask, returns + per_token - value_last, torch.zeros(())), metrics


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
