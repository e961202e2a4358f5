"""The policy losses beside GSPO's clipped surrogate, and the facts the config reads about each.

``policy_loss(..., surrogate=NAME, options=...)`` (losses.py) looks NAME up in ``SURROGATES``; each
entry returns per-token ``LossTerms`` (``(B, T)`` tensors) that ``policy_loss`` masks, weights and
aggregates like GSPO's. Notation: ``r = exp(logp - old)`` the token ratio, ``A`` the advantage,
``sg`` stop-gradient, ``m`` the response mask.

* ``clip``      PPO/GSPO clipped surrogate on the ``importance_sampling`` ratio (the default).
* ``cispo``     MiniMax-M1: ``-sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp``; optionally ROLL's
                unified mask (drop tokens the PPO clip would zero).
* ``sapo``      Qwen's soft gate: ``-f(r) * A`` with ``f(r) = sigmoid(tau (r-1)) * 4/tau``, tau the
                positive or negative temperature by the sign of ``A``.
* ``gmpo``      verl ``geo_mean``: per response ``-mean_t(A) * exp(mean_t sgn(A) min(sgn(A) l, sgn(A)
                clamp(l, -low, high)))`` with ``l = logp - old``: the geometric mean of token ratios,
                each clipped in log space. Averaged over responses.
* ``luspo``     TRL: GSPO's clipped sequence term scaled by the response length ``|y_i|``
                (``seq-mean-token-sum`` of the GSPO per-token loss).
* ``vespo``     TRL: ``-sg(phi(w)) * A * logp`` with ``w = exp(sum_t l)`` the sequence ratio and
                ``phi(w) = exp(lambda + k log w - lambda w)`` (k, lambda by the sign of ``A``).
* ``clip_cov``  verl: token PPO clip; a random ``clip_cov_ratio`` share of the valid tokens whose
                covariance ``(A - mean A)(logp - mean logp)`` lies in ``(lb, ub)`` (and that the clip
                left alone) get no gradient.
* ``kl_cov``    verl: ``-A * r``; the top ``kl_cov_ratio`` share of tokens by that covariance get
                ``+ coef * |l|`` as well.
* ``reinforce`` ROLL ``vanilla`` / verl ``gpg``: ``-A * logp``.
* ``tis``       ROLL: ``-sg(clip(r, lower, upper)) * A * logp``.
* ``topr``      ROLL (arXiv 2503.14286): positive responses ``-w+ * A * logp``, the others
                ``-w- * sg(clip(r, 0, 1)) * A * logp``.
* ``kimi15``    ROLL (Kimi k1.5): ``-A * logp + tau/2 * l^2``.

Selections of ``clip_cov`` / ``kl_cov`` (means, shares, top-k) are over the tokens of one call (a
micro-batch), as in verl. Extra metrics are ``(B, T)`` tensors whose masked mean is reported.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple

import torch

from roll_gspo.catalog.policy_losses import LOSS_SPECS, ROLL_PG_VARIANTS, SYNONYMS, LossSpec, canonical_loss

from .losses import (SURROGATES, SurrogateTerms, check_combination, compute_log_ratio, get_policy_loss,
                     get_surrogate, masked_mean, register_surrogate, token_log_ratio)

__all__ = ["LossTerms", "LossSpec", "SURROGATES", "LOSS_SPECS", "SYNONYMS", "ROLL_PG_VARIANTS",
           "register_surrogate", "get_surrogate", "canonical_loss", "check_combination"]

# verl's and SAPO's clamp of the token log-ratio before exp (keeps exp finite in fp32).
LOG_RATIO_CLAMP = 20.0
# TRL's VESPO clamps the sequence log-weight below at log(1e-8).
VESPO_LOG_W_MIN = -18.420680743952367


class LossTerms(NamedTuple):
    """Per-token pieces of a policy loss, all ``(B, T)``."""

    loss: torch.Tensor          # L_i,t (before masking / aggregation)
    ratio: torch.Tensor         # the importance ratio the loss reads (for the ratio metrics)
    clipped: torch.Tensor       # bool: the token's ratio or weight was clipped (actor/clipfrac)
    dual_clipped: torch.Tensor  # bool: the dual-clip cap applied (clip only)
    extra: Dict[str, torch.Tensor]  # metric name -> (B, T) values, reported as their masked mean


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _zeros_bool(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=torch.bool, device=like.device)


def _logp(log_probs: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log-probs in the compute dtype, 0 off the mask (garbage there must not reach a gradient)."""
    return torch.where(mask, log_probs.to(dtype), torch.zeros((), dtype=dtype, device=log_probs.device))


def _ratio(log_probs, old_log_probs, mask, level: str) -> torch.Tensor:
    """The importance ratio at `level` (token / seq / gspo-token), 1 off the mask."""
    return torch.exp(compute_log_ratio(log_probs, old_log_probs, mask, level))


def _opt(options: Mapping[str, Any], key: str, default: Any) -> Any:
    value = options.get(key, default)
    return default if value is None else value


def _row_sign_positive(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1) bool: the response's mean advantage over its valid tokens is > 0."""
    return (masked_mean(advantages, mask, dim=-1) > 0).unsqueeze(-1)


# --------------------------------------------------------------------------------------------
# The losses
# --------------------------------------------------------------------------------------------
@register_surrogate("clip", LOSS_SPECS["clip"])
def clip_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
              dual_clip_c=None, options) -> LossTerms:
    """The clipped surrogate of ``importance_sampling`` (losses.POLICY_LOSSES), as before."""
    terms: SurrogateTerms = get_policy_loss(importance_sampling)(
        log_probs, old_log_probs, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual_clip_c)
    return LossTerms(terms.loss, terms.ratio, terms.clipped, terms.dual_clipped, {})


@register_surrogate("luspo", LOSS_SPECS["luspo"])
def luspo_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
               dual_clip_c=None, options) -> LossTerms:
    """GSPO's per-token term; the length weighting is its aggregation (``seq-mean-token-sum``)."""
    return clip_loss(log_probs, old_log_probs, advantages, mask, importance_sampling="seq", clip_low=clip_low,
                     clip_high=clip_high, dual_clip_c=dual_clip_c, options=options)


def _clipped_weight_loss(log_probs, old_log_probs, advantages, mask, level, lower, upper, prefix):
    """``-sg(clip(r, lower, upper)) * A * logp`` and its low/high clip masks (CISPO, TIS)."""
    dtype = advantages.dtype
    ratio = _ratio(log_probs, old_log_probs, mask, level).detach()
    weight = ratio.clamp(lower, upper)
    low, high = ratio < lower, ratio > upper
    loss = -weight * advantages * _logp(log_probs, mask, dtype)
    extra = {f"actor/{prefix}_clipfrac_low": low.to(dtype), f"actor/{prefix}_clipfrac_high": high.to(dtype),
             f"actor/{prefix}_weight_mean": weight}
    return loss, ratio, low | high, extra


@register_surrogate("cispo", LOSS_SPECS["cispo"])
def cispo_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
               dual_clip_c=None, options) -> LossTerms:
    eps_low, eps_high = float(_opt(options, "cispo_epsilon_low", 0.1)), float(_opt(options, "cispo_epsilon_high", 0.1))
    lower, upper = 1.0 - eps_low, 1.0 + eps_high
    loss, ratio, clipped, extra = _clipped_weight_loss(log_probs, old_log_probs, advantages, mask, importance_sampling,
                                                       lower, upper, "cispo")
    if _opt(options, "cispo_use_unified_mask", False):
        # ROLL's unified mask (MiniMax-M1 eq. 7): drop the tokens PPO's clip would give no gradient.
        dropped = ((advantages > 0) & (ratio > upper)) | ((advantages < 0) & (ratio < lower))
        loss = torch.where(dropped, torch.zeros((), dtype=loss.dtype, device=loss.device), loss)
        extra["actor/cispo_masked_frac"] = dropped.to(loss.dtype)
    return LossTerms(loss, ratio, clipped, _zeros_bool(ratio), extra)


@register_surrogate("tis", LOSS_SPECS["tis"])
def tis_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
             dual_clip_c=None, options) -> LossTerms:
    lower, upper = float(_opt(options, "tis_lower_bound", 0.0)), float(_opt(options, "tis_upper_bound", 1.0))
    loss, ratio, clipped, extra = _clipped_weight_loss(log_probs, old_log_probs, advantages, mask, "token",
                                                       lower, upper, "tis")
    return LossTerms(loss, ratio, clipped, _zeros_bool(ratio), extra)


@register_surrogate("sapo", LOSS_SPECS["sapo"])
def sapo_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
              dual_clip_c=None, options) -> LossTerms:
    tau_pos = float(_opt(options, "sapo_temperature_pos", 1.0))
    tau_neg = float(_opt(options, "sapo_temperature_neg", 1.05))
    dtype = advantages.dtype
    log_ratio = compute_log_ratio(log_probs, old_log_probs, mask, importance_sampling)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    sig = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(sig * 4.0 / tau) * advantages
    with torch.no_grad():
        # d f(r) / d log r = 4 sigmoid (1 - sigmoid) r: the gate's gradient scale, 1 at r = 1.
        gate = 4.0 * sig * (1.0 - sig) * ratio
    extra = {"actor/sapo_gate_mean": gate, "actor/sapo_gate_off_frac": (gate < 0.5).to(dtype)}
    return LossTerms(loss, ratio, gate < 0.5, _zeros_bool(ratio), extra)


@register_surrogate("gmpo", LOSS_SPECS["gmpo"])
def gmpo_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
              dual_clip_c=None, options) -> LossTerms:
    """Per response ``-A_i * s_i``, on every valid token (``seq-mean-token-mean`` averages the
    responses); ``clip_low`` / ``clip_high`` bound each token's log-ratio."""
    dtype = advantages.dtype
    log_ratio = token_log_ratio(log_probs, old_log_probs, mask)
    seq_adv = masked_mean(advantages, mask, dim=-1).unsqueeze(-1)  # (B, 1)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-clip_low, clip_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = torch.exp(masked_mean(chosen, mask, dim=-1)).unsqueeze(-1)  # (B, 1)
    loss = (-seq_adv * seq_ratio).expand_as(log_ratio)
    clipped = log_ratio != clamped
    extra = {"actor/gmpo_clipfrac_high": (clipped & (advantages > 0)).to(dtype),
             "actor/gmpo_clipfrac_low": (clipped & (advantages < 0)).to(dtype)}
    return LossTerms(loss, seq_ratio.detach().expand_as(log_ratio), clipped, _zeros_bool(log_ratio), extra)


@register_surrogate("vespo", LOSS_SPECS["vespo"])
def vespo_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
               dual_clip_c=None, options) -> LossTerms:
    k_pos, lam_pos = float(_opt(options, "vespo_k_pos", 2.0)), float(_opt(options, "vespo_lambda_pos", 3.0))
    k_neg, lam_neg = float(_opt(options, "vespo_k_neg", 3.0)), float(_opt(options, "vespo_lambda_neg", 2.0))
    dtype = advantages.dtype
    with torch.no_grad():
        log_ratio = token_log_ratio(log_probs, old_log_probs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_w = log_ratio.sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)  # (B, 1)
        w = torch.exp(log_w)
        nonneg = advantages >= 0
        k = torch.where(nonneg, advantages.new_tensor(k_pos), advantages.new_tensor(k_neg))
        lam = torch.where(nonneg, advantages.new_tensor(lam_pos), advantages.new_tensor(lam_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * advantages * _logp(log_probs, mask, dtype)
    ratio = w.expand_as(log_ratio)
    extra = {"actor/vespo_phi_mean": phi, "actor/vespo_log_w_mean": log_w.expand_as(log_ratio)}
    return LossTerms(loss, ratio, _zeros_bool(ratio), _zeros_bool(ratio), extra)


def _covariance(advantages, log_probs, mask) -> torch.Tensor:
    """(A - mean A)(logp - mean logp), means over this call's valid tokens; no gradient."""
    logp = _logp(log_probs.detach(), mask, advantages.dtype)
    return (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))


@register_surrogate("clip_cov", LOSS_SPECS["clip_cov"])
def clip_cov_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
                  dual_clip_c=None, options) -> LossTerms:
    share = float(_opt(options, "clip_cov_ratio", 2e-4))
    lower, upper = float(_opt(options, "clip_cov_lb", 1.0)), float(_opt(options, "clip_cov_ub", 5.0))
    generator = options.get("generator")
    terms = get_policy_loss("token")(log_probs, old_log_probs, advantages, mask, clip_low=clip_low,
                                     clip_high=clip_high, dual_clip_c=None)
    with torch.no_grad():
        cov = _covariance(advantages, log_probs, mask)
        candidates = mask & ~terms.clipped & (cov > lower) & (cov < upper)
        where = torch.nonzero(candidates)  # (n, 2), row-major order
        count = max(int(share * int(mask.sum())), 1)
        detached = _zeros_bool(cov)
        if len(where):
            pick = where[torch.randperm(len(where), generator=generator)[:count]]
            detached[pick[:, 0], pick[:, 1]] = True
    loss = torch.where(detached, torch.zeros((), dtype=terms.loss.dtype), terms.loss)
    extra = {"actor/clip_cov_frac": detached.to(advantages.dtype)}
    return LossTerms(loss, terms.ratio, terms.clipped, _zeros_bool(cov), extra)


@register_surrogate("kl_cov", LOSS_SPECS["kl_cov"])
def kl_cov_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
                dual_clip_c=None, options) -> LossTerms:
    share, coef = float(_opt(options, "kl_cov_ratio", 2e-4)), float(_opt(options, "kl_cov_coef", 0.1))
    log_ratio = token_log_ratio(log_probs, old_log_probs, mask)
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio
    with torch.no_grad():
        cov = _covariance(advantages, log_probs, mask)
        valid = int(mask.sum())
        selected = _zeros_bool(cov)
        if valid:
            flat = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
            top = torch.topk(cov.reshape(-1)[flat], max(1, int(valid * share))).indices
            selected.view(-1)[flat[top]] = True
    loss = torch.where(selected, loss + coef * log_ratio.abs(), loss)
    extra = {"actor/kl_cov_frac": selected.to(advantages.dtype)}
    return LossTerms(loss, ratio, _zeros_bool(ratio), _zeros_bool(ratio), extra)


@register_surrogate("reinforce", LOSS_SPECS["reinforce"])
def reinforce_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
                   dual_clip_c=None, options) -> LossTerms:
    ratio = torch.exp(token_log_ratio(log_probs, old_log_probs, mask)).detach()
    loss = -advantages * _logp(log_probs, mask, advantages.dtype)
    return LossTerms(loss, ratio, _zeros_bool(ratio), _zeros_bool(ratio), {})


@register_surrogate("topr", LOSS_SPECS["topr"])
def topr_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
              dual_clip_c=None, options) -> LossTerms:
    """Positive responses: ROLL splits by the raw score > 0 (``options['scores']``, (B,)); without
    scores, by the response's mean advantage > 0 (the same split for 0/1 or +-1 rewards with a group
    baseline wherever the loss is not 0)."""
    w_pos, w_neg = float(_opt(options, "topr_positive_weight", 1.0)), float(_opt(options, "topr_negative_weight", 1.0))
    dtype = advantages.dtype
    scores = options.get("scores")
    positive = (scores.reshape(-1, 1) > 0) if scores is not None else _row_sign_positive(advantages, mask)
    positive = positive.expand_as(advantages)
    ratio = torch.exp(token_log_ratio(log_probs, old_log_probs, mask)).detach()
    weight = torch.where(positive, advantages.new_tensor(w_pos), w_neg * ratio.clamp(0.0, 1.0))
    loss = -weight * advantages * _logp(log_probs, mask, dtype)
    truncated = ~positive & (ratio > 1.0)
    extra = {"actor/topr_positive_frac": positive.to(dtype), "actor/topr_negative_clipfrac": truncated.to(dtype)}
    return LossTerms(loss, ratio, truncated, _zeros_bool(ratio), extra)


@register_surrogate("kimi15", LOSS_SPECS["kimi15"])
def kimi15_loss(log_probs, old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high,
                dual_clip_c=None, options) -> LossTerms:
    tau = float(_opt(options, "kimi15_tau", 0.1))
    log_ratio = token_log_ratio(log_probs, old_log_probs, mask)
    penalty = 0.5 * tau * log_ratio.square()
    loss = -advantages * _logp(log_probs, mask, advantages.dtype) + penalty
    extra = {"actor/kimi15_penalty": penalty.detach()}
    return LossTerms(loss, torch.exp(log_ratio).detach(), _zeros_bool(log_ratio), _zeros_bool(log_ratio), extra)
