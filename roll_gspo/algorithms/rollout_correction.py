"""Rollout correction: the train-inference mismatch between the rollout engine and the trainer.

The responses are sampled by the rollout engine (vLLM: its own kernels, often bf16), whose
distribution ``pi_rollout`` is not the trainer's ``pi_old`` even with identical weights. The policy
loss is an expectation under ``pi_old``, so each sample is re-weighted by the importance weight

    w = pi_old / pi_rollout = exp(old_logp - rollout_logp)

at one of three levels (ROLL's ``weight_type`` / ``agg_type``; verl's ``rollout_is`` /
``rollout_rs``):

* ``token``:     w_i,t = exp(old_i,t - rollout_i,t)                    one weight per token
* ``geometric``: w_i   = exp(mean_t over the mask of (old - rollout))  GSPO's unit: the
                 length-normalised (geometric-mean) sequence weight, shared by the response
* ``sequence``:  w_i   = exp(sum_t over the mask of (old - rollout))   the exact sequence weight
                 (high variance on long responses)

Then either truncated at an upper bound (TIS: ``w <- min(w, threshold)``), or tokens / responses
whose weight (or probability difference ``exp(old) - exp(rollout)``, ROLL's ``diff`` filter) is
outside a band are left out of the loss (MIS / rejection). Both log-probs are constants for the
update, so the weights carry no gradient.

Shapes: ``B`` responses by ``T`` response positions; every tensor is ``(B, T)``, ``response_mask``
nonzero on real response tokens. Values under the mask may be anything (NaN included).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = [
    "CORRECTION_LEVELS",
    "SAFETY_BOUND",
    "SEQUENCE_MEAN_METRICS",
    "RejectionRule",
    "RolloutCorrection",
    "kept_mask",
    "level_log_ratio",
    "level_prob_diff",
    "rollout_correction",
]

CORRECTION_LEVELS: List[str] = ["token", "geometric", "sequence"]
# Log-weights are clamped to [-SAFETY_BOUND, SAFETY_BOUND] before exp (as verl does): a sequence
# weight of a long response would otherwise overflow to inf.
SAFETY_BOUND = 20.0
# Metrics that are means over responses (not tokens): a caller averaging over micro-batches
# weights these by the number of responses with a valid token, the others by valid tokens.
SEQUENCE_MEAN_METRICS = frozenset({"rollout_correction/chi2_seq", "rollout_correction/log_ppl_diff",
                                   "rollout_correction/masked_seq_fraction"})


class RejectionRule(NamedTuple):
    """A band outside of which tokens (level ``token``) or whole responses are left out.

    ``ratio_low`` / ``ratio_high``: bounds of the weight at ``level`` (None: no ratio test).
    ``diff_low`` / ``diff_high``: bounds of ``exp(old) - exp(rollout)`` at ``level`` (the mean over
    the response for ``geometric``, the sum for ``sequence``; None: no difference test).
    A value on a bound is kept.
    """

    level: str
    ratio_low: Optional[float] = None
    ratio_high: Optional[float] = None
    diff_low: Optional[float] = None
    diff_high: Optional[float] = None


class RolloutCorrection(NamedTuple):
    """What the policy loss applies, both ``(B, T)`` and detached."""

    weights: torch.Tensor  # importance weight per token (its response's at sequence levels), 1 off the mask
    keep: torch.Tensor     # bool: the token stays in the loss (False off the mask and where rejected)


def kept_mask(response_mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The tokens the loss sees once the rejection is applied: ``response_mask`` where ``keep``.

    response_mask: ``(B, T)`` (any dtype, nonzero = valid); keep: ``(B, T)`` bool (``RolloutCorrection.keep``).
    Returns ``(B, T)`` in ``response_mask``'s dtype. It is the mask of the loss's numerators AND of its
    normalisers (``N_tokens``, ``N_seqs``, counted over the whole mini-batch: ``losses.loss_normalisers``),
    so a rejected token or response is as if it had never been sampled: the rejection changes which
    tokens train, not the size of the step.
    """
    if tuple(keep.shape) != tuple(response_mask.shape):
        raise ValueError(f"keep {tuple(keep.shape)} and response_mask {tuple(response_mask.shape)} differ in shape")
    return response_mask * keep.to(response_mask.dtype)


def _check_level(level: str) -> None:
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; valid values: {CORRECTION_LEVELS}")


def _row_reduce(per_token: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``(B, T)`` -> ``(B, T)``: itself (token), or its row's masked mean (geometric) / sum
    (sequence) on every position of the row. ``per_token`` is already 0 off the mask."""
    if level == "token":
        return per_token
    total = per_token.sum(-1, keepdim=True)
    if level == "sequence":
        return total.expand_as(per_token)
    count = mask.to(per_token.dtype).sum(-1, keepdim=True).clamp(min=1)
    return (total / count).expand_as(per_token)


def level_log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                    response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Log importance weight ``log(pi_old / pi_rollout)`` at ``level``.

    old_log_probs, rollout_log_probs, response_mask: ``(B, T)``. Returns ``(B, T)`` in float32 or
    wider, 0 off the mask; at sequence levels every valid token carries its row's value.
    """
    _check_level(level)
    mask = response_mask != 0
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    diff = old_log_probs.to(dtype) - rollout_log_probs.to(dtype)
    per_token = torch.where(mask, diff, torch.zeros((), dtype=dtype, device=diff.device))
    return torch.where(mask, _row_reduce(per_token, mask, level), torch.zeros((), dtype=dtype, device=diff.device))


def level_prob_diff(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                    response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Probability difference ``exp(old) - exp(rollout)`` at ``level`` (token value, row mean for
    ``geometric``, row sum for ``sequence``). ``(B, T)`` in, ``(B, T)`` out, 0 off the mask."""
    _check_level(level)
    mask = response_mask != 0
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_log_probs.device)
    diff = torch.where(mask, old_log_probs.to(dtype).exp() - rollout_log_probs.to(dtype).exp(), zero)
    return torch.where(mask, _row_reduce(diff, mask, level), zero)


def _within(values: torch.Tensor, low: Optional[float], high: Optional[float]) -> torch.Tensor:
    keep = torch.ones_like(values, dtype=torch.bool)
    if low is not None:
        keep &= values >= low
    if high is not None:
        keep &= values <= high
    return keep


@torch.no_grad()
def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor, *, is_level: Optional[str] = None,
                       is_threshold: Optional[float] = None,
                       rejections: Sequence[RejectionRule] = ()) -> Tuple[RolloutCorrection, Dict[str, float]]:
    """Importance weights (``is_level``, truncated at ``is_threshold``) and the rejection mask
    (``rejections``, applied one after the other) between the trainer's old policy and the rollout
    engine's, with diagnostics of the gap.

    old_log_probs, rollout_log_probs, response_mask: ``(B, T)``. ``is_level``: None (weights 1)
    or a ``CORRECTION_LEVELS`` name; ``is_threshold``: None (no truncation) or the upper bound (> 1).
    Returns ``(RolloutCorrection, metrics)``; metrics (python floats) over the valid tokens:

    * ``rollout_correction/weight_mean`` / ``weight_max``: the applied (truncated) weights;
    * ``rollout_correction/clipped_fraction``: tokens whose weight was truncated;
    * ``rollout_correction/masked_fraction``: tokens left out by the rejection rules;
    * ``rollout_correction/masked_seq_fraction``: responses left with no token (a response mean);
    * the gap, as verl logs it: ``kl`` = mean(rollout - old) (estimates KL(pi_rollout || pi_old)),
      ``k3_kl`` = mean(w - log w - 1) of token weights, ``chi2_token`` = mean(w^2) - 1,
      ``chi2_seq`` = mean over responses of exp(2 sum log w) - 1, ``log_ppl_diff`` = mean over
      responses of (mean rollout - mean old); the last two are response means, as is
      ``masked_seq_fraction`` (``SEQUENCE_MEAN_METRICS``). Log-weights are clamped to
      +-SAFETY_BOUND in all of them.
    """
    shapes = {tuple(t.shape) for t in (old_log_probs, rollout_log_probs, response_mask)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"expected tensors of one (batch, response_len) shape, got {sorted(shapes)}")
    if is_level is not None:
        _check_level(is_level)
    if is_threshold is not None and not is_threshold > 1.0:
        raise ValueError(f"is_threshold must be > 1 (a weight bound at or below 1 truncates every "
                         f"sample the rollout engine under-weights), got {is_threshold}")
    mask = response_mask != 0
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_log_probs.device)

    clipped = torch.zeros_like(mask)
    if is_level is None:
        weights = torch.ones(mask.shape, dtype=dtype, device=mask.device)
    else:
        log_w = level_log_ratio(old_log_probs, rollout_log_probs, mask, is_level)
        weights = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        if is_threshold is not None:
            clipped = mask & (weights > is_threshold)
            weights = weights.clamp(max=is_threshold)
        weights = torch.where(mask, weights, torch.ones((), dtype=dtype, device=mask.device))

    keep = mask.clone()
    for rule in rejections:
        _check_level(rule.level)
        if rule.ratio_low is not None or rule.ratio_high is not None:
            ratio = torch.exp(level_log_ratio(old_log_probs, rollout_log_probs, mask, rule.level)
                              .clamp(-SAFETY_BOUND, SAFETY_BOUND))
            keep &= _within(ratio, rule.ratio_low, rule.ratio_high)
        if rule.diff_low is not None or rule.diff_high is not None:
            diff = level_prob_diff(old_log_probs, rollout_log_probs, mask, rule.level)
            keep &= _within(diff, rule.diff_low, rule.diff_high)

    # Diagnostics of the gap itself (whatever is applied).
    tokens = mask.to(dtype).sum()
    token_mean = lambda x: float(torch.where(mask, x, zero).sum() / tokens.clamp(min=1))  # noqa: E731
    log_ratio = level_log_ratio(old_log_probs, rollout_log_probs, mask, "token").clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.exp(log_ratio)
    rows = mask.any(-1)
    n_rows = rows.to(dtype).sum().clamp(min=1)
    # Per response: the sum of the (unclamped) token log-weights, and their mean.
    token_log = level_log_ratio(old_log_probs, rollout_log_probs, mask, "token")
    seq_log = token_log.sum(-1)
    geo_log = seq_log / mask.to(dtype).sum(-1).clamp(min=1)
    seq_log = seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    has_tokens = bool(mask.any())
    metrics = {
        "rollout_correction/weight_mean": token_mean(weights),
        "rollout_correction/weight_max": float(weights[mask].max()) if has_tokens else 1.0,
        "rollout_correction/clipped_fraction": token_mean(clipped.to(dtype)),
        "rollout_correction/masked_fraction": token_mean((mask & ~keep).to(dtype)),
        "rollout_correction/masked_seq_fraction": float((rows & ~keep.any(-1)).to(dtype).sum() / n_rows),
        "rollout_correction/kl": token_mean(-log_ratio),
        "rollout_correction/k3_kl": token_mean(rho - log_ratio - 1.0),
        "rollout_correction/chi2_token": token_mean(rho.square()) - 1.0 if has_tokens else 0.0,
        "rollout_correction/chi2_seq": float(torch.where(rows, torch.exp(2.0 * seq_log) - 1.0, zero).sum() / n_rows),
        # mean rollout - mean old = -(geometric log-weight), per response
        "rollout_correction/log_ppl_diff": float(torch.where(rows, -geo_log, zero).sum() / n_rows),
    }
    return RolloutCorrection(weights=weights, keep=keep), metrics
