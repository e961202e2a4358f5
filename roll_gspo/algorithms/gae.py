"""Generalised advantage estimation and the clipped value loss (PPO with a critic), in plain torch.

`adv_estimator: gae` runs them: the driver calls `compute_gae_advantages` with the critic's
values, the critic worker (roll_gspo.workers.critic) trains on `value_loss`.

Shapes: ``B`` responses by ``T`` response positions; every tensor is ``(B, T)``; ``response_mask``
is nonzero on the tokens the policy produced. Positions under mask 0 (padding, or tool / env
tokens inside an agentic response) are skipped: the recursion carries its running values across
them, so a hole in the mask neither ends an episode nor takes a value there. Values under mask 0
may be anything (NaN included).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .advantages import RunningMeanStd, finish_advantages, shaped_token_rewards
from .losses import LOSS_AGG_MODES, bool_mask, aggregate_loss, masked_mean

__all__ = ["gae_advantages", "value_loss", "compute_gae_advantages"]


def _zero_off_mask(mask: torch.Tensor, like: torch.Tensor, *tensors: torch.Tensor):
    """``(zero, tensors)``: each ``(B, T)`` tensor in ``like``'s dtype promoted to at least fp32,
    0 where ``mask`` (bool ``(B, T)``) is False; ``zero`` is that dtype's scalar 0 on ``like``'s device."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=like.device)
    return zero, [torch.where(mask, t.to(dtype), zero) for t in tensors]


@torch.no_grad()
def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
                   gamma: float = 1.0, lambd: float = 0.95) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE: ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lambd * A_next``,
    where "next" is the next valid position (0 after the last: the response ends the episode).

    token_rewards, values, response_mask: ``(B, T)``. Returns ``(advantages, returns)``, both
    ``(B, T)`` with ``returns = advantages + values``, 0 off the mask. ``gamma``, ``lambd`` in [0, 1].
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lambd <= 1.0):
        raise ValueError(f"gamma and lambd must be in [0, 1], got {gamma}, {lambd}")
    shapes = {tuple(t.shape) for t in (token_rewards, values, response_mask)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"expected tensors of one (batch, response_len) shape, got {sorted(shapes)}")
    mask = bool_mask(response_mask)
    zero, (rewards, values) = _zero_off_mask(mask, values, token_rewards, values)
    dtype = zero.dtype
    rows, width = mask.shape
    next_value = torch.zeros(rows, dtype=dtype, device=values.device)
    next_advantage = torch.zeros(rows, dtype=dtype, device=values.device)
    advantages = torch.zeros(rows, width, dtype=dtype, device=values.device)
    for t in reversed(range(width)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        advantages[:, t] = torch.where(valid, advantage, zero)
        # a skipped position passes the running values through unchanged
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = torch.where(mask, advantages + values, zero)
    return advantages, returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, *, value_clip: Optional[float] = None,
               loss_agg_mode: str = "token-mean", num_seqs=None, num_tokens=None,
               norm_length: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO's value loss ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token
    (the plain squared error when ``value_clip`` is None), aggregated like the policy loss.

    values (with grad), old_values (the critic's before the update), returns, response_mask:
    ``(B, T)``. Returns ``(loss, metrics)``: ``critic/vf_loss``, ``critic/vf_clipfrac`` (tokens whose
    clipped branch is larger), ``critic/vpred_mean``, ``critic/returns_mean``.
    """
    if value_clip is not None and not value_clip > 0:
        raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid values: {LOSS_AGG_MODES}")
    mask = bool_mask(response_mask)
    # Garbage off the mask is replaced before any arithmetic so it cannot reach the gradient.
    zero, (v, old, target) = _zero_off_mask(mask, values, values, old_values, returns)
    dtype = zero.dtype
    unclipped = (v - target).square()
    if value_clip is None:
        per_token, clipped = 0.5 * unclipped, torch.zeros_like(mask)
    else:
        v_clipped = old + (v - old).clamp(-value_clip, value_clip)
        clipped_error = (v_clipped - target).square()
        clipped = clipped_error > unclipped
        per_token = 0.5 * torch.where(clipped, clipped_error, unclipped)
    loss = aggregate_loss(per_token, mask, loss_agg_mode, num_seqs=num_seqs, num_tokens=num_tokens,
                          norm_length=norm_length)
    with torch.no_grad():
        metrics = {"critic/vf_loss": float(loss.detach()),
                   "critic/vf_clipfrac": float(masked_mean(clipped.to(dtype), mask)),
                   "critic/vpred_mean": float(masked_mean(v.detach(), mask)),
                   "critic/returns_mean": float(masked_mean(target, mask))}
    return loss, metrics


def compute_gae_advantages(scores: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
                           group_size: int, gamma: float = 1.0, lambd: float = 0.95,
                           reward_norm: Optional[str] = None, reward_shift: bool = False,
                           reward_scale: bool = False, reward_clip: Optional[float] = None,
                           running_stats: Optional[RunningMeanStd] = None, kl: Optional[torch.Tensor] = None,
                           kl_coef: float = 0.0, whiten_advantages: bool = False,
                           advantage_clip: Optional[float] = None,
                           eps: float = 1e-6) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """PPO's advantages: ``compute_advantages``' chain with GAE over the critic's ``values`` as the
    estimator (normalise and clip rewards -> the reward on each response's last token, minus
    ``kl_coef * kl`` per token -> ``gae_advantages`` -> whiten -> clip advantages).

    scores: ``(B,)``; values, response_mask, kl: ``(B, T)``. Returns ``(advantages, returns,
    metrics)``: advantages and returns ``(B, T)``, 0 off the mask; the returns (the critic's
    targets) are GAE's, before whitening and clipping, as in ROLL. metrics as compute_advantages',
    plus ``critic/values_mean``.
    """
    token_rewards, metrics = shaped_token_rewards(
        scores, response_mask, group_size=group_size, reward_norm=reward_norm, reward_shift=reward_shift,
        reward_scale=reward_scale, reward_clip=reward_clip, running_stats=running_stats, kl=kl, kl_coef=kl_coef,
        eps=eps)
    mask = bool_mask(response_mask)
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma=gamma, lambd=lambd)
    metrics["critic/returns_mean"] = float(masked_mean(returns, mask))
    metrics["critic/values_mean"] = float(masked_mean(torch.where(mask, values.float(), 0.0), mask))
    advantages, metrics = finish_advantages(advantages, mask, metrics, whiten_advantages=whiten_advantages,
                                            advantage_clip=advantage_clip)
    return advantages, returns.detach(), metrics
