"""Policy losses for GSPO / GRPO / PPO-style training, in plain torch.

Shapes: ``B`` responses (rows) by ``T`` response positions (columns). Every per-token tensor is
``(B, T)``; ``response_mask`` is 1 (or True) on real response tokens and 0 on padding. Values under
``mask == 0`` may be anything, NaN and inf included: they never reach a result or a gradient.

Three importance-sampling modes (see ``docs``/``gspo.md``):

* ``token``      rho_i,t = exp(logp_i,t - old_i,t)                         (PPO / GRPO)
* ``seq``        s_i     = exp(mean_t over the mask of (logp - old)),      (GSPO)
                 shared by all tokens of response i; the gradient flows through the mean.
* ``gspo-token`` s_i,t   = sg[s_i] * exp(logp_i,t - sg[logp_i,t])          (GSPO-token)
                 equal to ``seq`` in value; its gradient is per token, so it only differs from
                 ``seq`` when advantages vary along a response.

Each mode is registered in ``POLICY_LOSSES`` (``register_policy_loss``) as a function returning the
per-token clipped surrogate; ``policy_loss`` looks the mode up, aggregates with ``aggregate_loss``
and reports metrics. Functions that produce a loss return ``(loss, metrics)`` with ``metrics`` a
dict of python floats.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "SurrogateTerms",
    "register_policy_loss",
    "get_policy_loss",
    "masked_mean",
    "masked_sum",
    "entropy_from_logits",
    "token_log_ratio",
    "seq_log_ratio",
    "gspo_token_log_ratio",
    "compute_log_ratio",
    "compute_importance_ratio",
    "clipped_surrogate",
    "aggregate_loss",
    "loss_normalisers",
    "policy_loss",
    "SURROGATES",
    "register_surrogate",
    "get_surrogate",
    "check_combination",
    "kl_penalty",
    "kl_loss",
]

# Same names, same order as roll_gspo.schema.config (a test keeps them in sync). They are not
# imported from there so that this library needs torch alone.
LOSS_AGG_MODES: List[str] = [
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_ESTIMATORS: List[str] = ["k1", "k2", "k3"]
# k3 takes exp(ref - logp): one token the policy has all but ruled out (logp - ref = -100) would
# overflow fp32 to inf (and its gradient to NaN), so the log-ratio is clamped first. That alone
# still lets one token carry a gradient of -exp(19) ~ -1.8e8 at a log-ratio of -19 (a finite loss,
# which after gradient clipping dominates the update), so the k3 value is clamped too: beyond
# K3_VALUE_BOUND (log-ratio below ~-2.6 or above ~11) a token adds a constant, no gradient, and
# inside it the gradient stays below ~13. verl's low_var_kl clamps both, at the same bounds
# (it also clamps the value from below at -10, which k3 >= 0 never reaches).
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0

Count = Union[int, float, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------
def bool_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` float/int/bool mask -> bool mask (nonzero = valid token)."""
    return response_mask if response_mask.dtype == torch.bool else response_mask != 0


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is 2-D and all share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"expected tensors of one (batch, response_len) shape, got {shapes}")


def registering(table: Dict[str, Any], kind: str, name: str) -> Callable[[Any], Any]:
    """A decorator putting a function in `table` under `name`; a different function under a name
    already taken is an error (the same one again, e.g. a module imported twice, is not)."""
    def decorator(fn):
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = fn
        return fn
    return decorator


def _check_choice(kind: str, value: object, valid: List) -> None:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid values: {valid}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Ratios of bf16/fp16 log-probs near 1 lose the 1e-4 differences GSPO clips on: use fp32.
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is nonzero; entries under mask 0 (even NaN/inf) are ignored.

    values, mask: same shape (typically ``(B, T)``). dim: None (all) or one dimension.
    Returns a scalar tensor, or ``values`` reduced over ``dim``.
    """
    selected = torch.where(bool_mask(mask), values, torch.zeros((), dtype=values.dtype,
                                                                 device=values.device))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor,
                dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over entries where ``mask`` is nonzero (0 where nothing is valid).

    values, mask: same shape. dim: None (all entries, scalar result) or one dimension (reduced).
    """
    count = bool_mask(mask).to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at every position.

    logits: ``(B, T, V)``. Returns ``(B, T)``: ``logsumexp(z) - sum softmax(z) * z``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# --------------------------------------------------------------------------------------------
# Importance ratios
# --------------------------------------------------------------------------------------------
def token_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                    response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token log ratio ``logp - old_logp``, 0 outside the mask.

    log_probs, old_log_probs, response_mask: ``(B, T)``. Returns ``(B, T)``.
    Zero (not the raw difference) outside the mask so that ``exp`` of padding garbage can
    neither overflow nor send NaN into the backward pass.
    """
    dtype = _compute_dtype(log_probs)
    diff = log_probs.to(dtype) - old_log_probs.to(dtype)
    return torch.where(bool_mask(response_mask), diff, torch.zeros((), dtype=dtype,
                                                                    device=diff.device))


def seq_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                  response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log ratio ``(1/|y_i|) sum_t m (logp - old)``.

    log_probs, old_log_probs, response_mask: ``(B, T)``. Returns ``(B, T)``: the row's value on
    its valid tokens (the gradient flows through the mean to every token), 0 outside the mask.
    A row with no valid token gets 0 (ratio 1).
    """
    per_token = token_log_ratio(log_probs, old_log_probs, response_mask)
    seq_value = masked_mean(per_token, response_mask, dim=-1)  # (B,)
    return torch.where(bool_mask(response_mask), seq_value.unsqueeze(-1),
                       torch.zeros((), dtype=per_token.dtype, device=per_token.device))


def gspo_token_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                         response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token log ratio ``sg[log s_i] + logp_i,t - sg[logp_i,t]``.

    log_probs, old_log_probs, response_mask: ``(B, T)``. Returns ``(B, T)``, 0 outside the mask.
    Its value equals ``seq_log_ratio``; its gradient w.r.t. ``logp_i,t`` is 1 (times ``s_i`` once
    exponentiated), so each token is weighted by its own advantage.
    """
    dtype = _compute_dtype(log_probs)
    logp = log_probs.to(dtype)
    seq_value = seq_log_ratio(log_probs, old_log_probs, response_mask).detach()
    token_grad_carrier = logp - logp.detach()  # value 0, gradient 1
    return torch.where(bool_mask(response_mask), seq_value + token_grad_carrier,
                       torch.zeros((), dtype=dtype, device=logp.device))


_LOG_RATIO_FNS: Dict[str, Callable[..., torch.Tensor]] = {
    "token": token_log_ratio,
    "seq": seq_log_ratio,
    "gspo-token": gspo_token_log_ratio,
}


def compute_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                      response_mask: torch.Tensor,
                      importance_sampling: str = "seq") -> torch.Tensor:
    """Log importance ratio for ``importance_sampling`` in ``token``, ``seq``, ``gspo-token``.

    log_probs, old_log_probs, response_mask: ``(B, T)``. Returns ``(B, T)``, 0 outside the mask.
    """
    _check_choice("importance_sampling", importance_sampling, list(_LOG_RATIO_FNS))
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, response_mask=response_mask)
    return _LOG_RATIO_FNS[importance_sampling](log_probs, old_log_probs, response_mask)


def compute_importance_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                             response_mask: torch.Tensor,
                             importance_sampling: str = "seq") -> torch.Tensor:
    """Importance ratio ``exp(compute_log_ratio(...))``: ``(B, T)``, 1 outside the mask."""
    log_ratio = compute_log_ratio(log_probs, old_log_probs, response_mask, importance_sampling)
    return torch.exp(log_ratio)


# --------------------------------------------------------------------------------------------
# Clipped surrogate and the policy-loss registry
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def response_ratios(log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
                    importance_sampling: str, clip_low: float, clip_high: float
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each response's importance ratio and clipped share, for the rollout files (what a reader of
    one sample wants: how far the policy had moved, and whether clipping held it).

    log_probs, old_log_probs, response_mask: ``(B, T)``. Returns ``ratio (B,)``, GSPO's sequence
    ratio ``exp(mean_t (logp - old))``, and ``clipped (B,)``: with sequence ratios (seq,
    gspo-token) 1.0 when that ratio is outside ``[1 - clip_low, 1 + clip_high]``, else 0.0; with
    token ratios the share of the response's tokens outside the band (clipfrac's definition:
    outside, whichever the advantage's sign). A response without tokens: ratio 1, clipped 0.
    """
    per_token = token_log_ratio(log_probs, old_log_probs, response_mask)
    mask = response_mask.to(per_token.dtype)
    counts = mask.sum(-1)
    ratio = torch.exp(per_token.sum(-1) / counts.clamp(min=1.0))
    outside = lambda r: ((r < 1.0 - clip_low) | (r > 1.0 + clip_high)).to(per_token.dtype)  # noqa: E731
    if importance_sampling == "token":
        clipped = (outside(torch.exp(per_token)) * mask).sum(-1) / counts.clamp(min=1.0)
    else:
        clipped = outside(ratio) * (counts > 0).to(per_token.dtype)
    return ratio, clipped


class SurrogateTerms(NamedTuple):
    """Per-token pieces of a clipped surrogate, all ``(B, T)``."""

    loss: torch.Tensor          # L_i,t (before masking / aggregation)
    ratio: torch.Tensor         # the importance ratio used
    clipped: torch.Tensor       # bool: the clipped branch was chosen and differs
    dual_clipped: torch.Tensor  # bool: the dual-clip cap -c*A was applied


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, *, clip_low: float,
                      clip_high: float, dual_clip_c: Optional[float] = None) -> SurrogateTerms:
    """PPO clipped surrogate per token, with optional dual clip.

    ratio, advantages: ``(B, T)``. Returns ``SurrogateTerms`` of ``(B, T)`` tensors with
    ``L = max(-ratio*A, -clip(ratio, 1-clip_low, 1+clip_high)*A)`` and, when ``dual_clip_c`` is
    given, ``L = min(L, -c*A)`` where ``A < 0``.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # torch.where (not maximum) so the gradient goes wholly to the chosen branch; the clipped
    # branch carries none because clamp passes no gradient outside its bounds.
    clipped = loss_clipped > loss_unclipped
    loss = torch.where(clipped, loss_clipped, loss_unclipped)
    if dual_clip_c is None:
        dual_clipped = torch.zeros_like(clipped)
    else:
        dual_cap = -dual_clip_c * advantages
        dual_clipped = (advantages < 0) & (loss > dual_cap)
        loss = torch.where(dual_clipped, dual_cap, loss)
    return SurrogateTerms(loss=loss, ratio=ratio, clipped=clipped, dual_clipped=dual_clipped)


PolicyLossFn = Callable[..., SurrogateTerms]
POLICY_LOSSES: Dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a per-token policy loss under an ``importance_sampling`` name.

    The function is called as ``fn(log_probs, old_log_probs, advantages, response_mask, *,
    clip_low, clip_high, dual_clip_c)`` with ``(B, T)`` tensors and returns ``SurrogateTerms``.
    """
    return registering(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The per-token policy loss registered as ``name``; ValueError listing valid names."""
    _check_choice("importance_sampling", name, list(POLICY_LOSSES))
    return POLICY_LOSSES[name]


@register_policy_loss("seq")
def seq_policy_loss(log_probs, old_log_probs, advantages, response_mask, *, clip_low, clip_high,
                    dual_clip_c=None) -> SurrogateTerms:
    """GSPO: one length-normalised ratio per response. Tensors ``(B, T)``; ``SurrogateTerms``."""
    ratio = torch.exp(seq_log_ratio(log_probs, old_log_probs, response_mask))
    return clipped_surrogate(ratio, advantages, clip_low=clip_low, clip_high=clip_high,
                             dual_clip_c=dual_clip_c)


@register_policy_loss("token")
def token_policy_loss(log_probs, old_log_probs, advantages, response_mask, *, clip_low, clip_high,
                      dual_clip_c=None) -> SurrogateTerms:
    """PPO/GRPO: per-token ratio. All tensors ``(B, T)``; returns per-token ``SurrogateTerms``."""
    ratio = torch.exp(token_log_ratio(log_probs, old_log_probs, response_mask))
    return clipped_surrogate(ratio, advantages, clip_low=clip_low, clip_high=clip_high,
                             dual_clip_c=dual_clip_c)


@register_policy_loss("gspo-token")
def gspo_token_policy_loss(log_probs, old_log_probs, advantages, response_mask, *, clip_low,
                           clip_high, dual_clip_c=None) -> SurrogateTerms:
    """GSPO-token: sequence-ratio value, per-token gradient. ``(B, T)``; ``SurrogateTerms``."""
    ratio = torch.exp(gspo_token_log_ratio(log_probs, old_log_probs, response_mask))
    return clipped_surrogate(ratio, advantages, clip_low=clip_low, clip_high=clip_high,
                             dual_clip_c=dual_clip_c)


# --------------------------------------------------------------------------------------------
# The registry of policy losses (`policy_loss`'s `surrogate`; filled by policy_losses.py, which the
# package imports)
# --------------------------------------------------------------------------------------------
SURROGATES: Dict[str, Callable[..., Any]] = {}
SURROGATE_SPECS: Dict[str, Any] = {}  # name -> policy_losses.LossSpec: the ratios and aggregations it takes


def register_surrogate(name: str, spec: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering a policy loss under its ``policy_loss`` name with its ``spec``
    (``ratio_levels``, ``agg_modes``, ``why_ratio``, ``why_agg``). Called as ``fn(log_probs,
    old_log_probs, advantages, mask, *, importance_sampling, clip_low, clip_high, dual_clip_c,
    options)`` with ``(B, T)`` tensors (advantages zero off the mask); returns per-token terms with
    ``loss``, ``ratio``, ``clipped``, ``dual_clipped`` and ``extra`` (metric name -> ``(B, T)``)."""
    def decorator(fn):
        registering(SURROGATES, "policy loss", name)(fn)
        SURROGATE_SPECS[name] = spec
        return fn
    return decorator


def get_surrogate(name: str) -> Callable[..., Any]:
    _check_choice("policy loss", name, sorted(SURROGATES))
    return SURROGATES[name]


def check_combination(name: str, importance_sampling: str, loss_agg_mode: str) -> None:
    """ValueError unless the loss ``name`` is defined on this ratio level and aggregation."""
    spec = SURROGATE_SPECS[name]
    if importance_sampling not in spec.ratio_levels:
        raise ValueError(f"policy loss {name!r} does not take importance_sampling {importance_sampling!r} "
                         f"(accepted: {list(spec.ratio_levels)}): {spec.why_ratio}")
    if loss_agg_mode not in spec.agg_modes:
        raise ValueError(f"policy loss {name!r} does not take loss_agg_mode {loss_agg_mode!r} "
                         f"(accepted: {list(spec.agg_modes)}): {spec.why_agg}")


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------
def _denominator(local: torch.Tensor, given: Optional[Count], name: str) -> torch.Tensor:
    """The local count, or the caller's global one; clamped to >= 1 (an empty batch -> loss 0)."""
    if given is None:
        return local.clamp(min=1)
    value = torch.as_tensor(given, dtype=local.dtype, device=local.device)
    if bool((value < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {given}")
    return value.clamp(min=1)


def loss_normalisers(response_mask: torch.Tensor) -> Tuple[float, float]:
    """``(N_seqs, N_tokens)`` of a ``(B, T)`` mask: rows with a valid token, and valid tokens.

    What ``aggregate_loss`` counts on its own; a trainer sums these over the micro-batches of a
    mini-batch and over data-parallel ranks and passes them as ``num_seqs`` / ``num_tokens``. Count
    on the mask the loss sees: with the rollout correction's rejection, the kept tokens
    (``rollout_correction.kept_mask``), so that rejected tokens and responses leave the normalisers
    as well as the numerators and the step size does not move with the rejection rate.
    """
    mask = bool_mask(response_mask)
    if mask.dim() != 2:
        raise ValueError(f"expected a (batch, response_len) mask, got shape {tuple(mask.shape)}")
    return float(mask.any(-1).sum()), float(mask.sum())


def aggregate_loss(loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, *,
                   num_seqs: Optional[Count] = None, num_tokens: Optional[Count] = None,
                   norm_length: Optional[float] = None) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar.

    loss_mat, response_mask: ``(B, T)``. Returns a scalar tensor.

    * ``token-mean``:              ``sum(L*m) / N_tokens``
    * ``seq-mean-token-sum``:      ``sum_i sum_t L*m / N_seqs``
    * ``seq-mean-token-mean``:     ``sum_i (sum_t L*m / |y_i|) / N_seqs``
    * ``seq-mean-token-sum-norm``: ``sum(L*m) / (N_seqs * T_norm)``

    Only valid tokens enter the numerators; rows without a valid token are not counted in
    ``N_seqs``. By default ``N_seqs`` / ``N_tokens`` are this call's valid rows / tokens. Pass the
    counts of the whole mini-batch (all data-parallel ranks, all micro-batches) as ``num_seqs`` /
    ``num_tokens`` and the micro-batch losses sum (over micro-batches and ranks) to exactly the
    mini-batch loss, so the gradient does not depend on how the batch was split.
    ``norm_length`` is ``T_norm`` (default ``loss_mat.shape[1]``, which changes with padding:
    pipelines should pass the configured response length).
    """
    _check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    _check_same_shape(loss_mat=loss_mat, response_mask=response_mask)
    mask = bool_mask(response_mask)
    token_counts = mask.to(loss_mat.dtype).sum(-1)  # (B,)
    row_sums = masked_sum(loss_mat, mask, dim=-1)    # (B,)

    if loss_agg_mode == "token-mean":
        return row_sums.sum() / _denominator(token_counts.sum(), num_tokens, "num_tokens")

    seqs = _denominator((token_counts > 0).to(loss_mat.dtype).sum(), num_seqs, "num_seqs")
    if loss_agg_mode == "seq-mean-token-sum":
        return row_sums.sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        # Empty rows have row_sums 0, so the clamp only avoids 0/0.
        return (row_sums / token_counts.clamp(min=1)).sum() / seqs
    # seq-mean-token-sum-norm
    t_norm = loss_mat.shape[1] if norm_length is None else norm_length
    if not t_norm > 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    return row_sums.sum() / (seqs * t_norm)


# --------------------------------------------------------------------------------------------
# The policy loss
# --------------------------------------------------------------------------------------------
def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, *, importance_sampling: str = "seq",
                clip_low: float = 3e-4, clip_high: float = 4e-4,
                loss_agg_mode: str = "seq-mean-token-mean", dual_clip_c: Optional[float] = None,
                num_seqs: Optional[Count] = None, num_tokens: Optional[Count] = None,
                norm_length: Optional[float] = None,
                token_weights: Optional[torch.Tensor] = None, surrogate: str = "clip",
                options: Optional[Dict[str, Any]] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Policy-gradient loss (GSPO's clipped surrogate by default) and its metrics.

    log_probs (with grad), old_log_probs, advantages, response_mask: ``(B, T)``.
    Returns ``(loss, metrics)``: a scalar tensor and python floats

    * ``actor/pg_loss``: the loss value;
    * ``actor/clipfrac``: fraction of valid tokens whose clipped branch is chosen and differs;
    * ``actor/dual_clipfrac``: fraction of valid tokens capped by the dual clip;
    * ``actor/ratio_mean`` / ``_min`` / ``_max``: the ratio used, over valid tokens (in ``seq``
      mode every token of a response carries its response's ratio);
    * ``actor/ppo_kl``: mean over valid tokens of ``old_logp - logp`` (token level, any mode).

    Metrics are over this call's tokens only. ``num_seqs`` / ``num_tokens`` / ``norm_length``
    are passed to ``aggregate_loss``; ``dual_clip_c`` (> 1) enables the dual clip.
    ``token_weights`` (``(B, T)``, no gradient; e.g. the rollout correction's importance weights)
    multiply each token's loss before aggregation.

    ``surrogate`` names the loss (``policy_losses.SURROGATES``: ``clip``, the clipped surrogate of
    ``importance_sampling``, or cispo, sapo, gmpo, luspo, vespo, clip_cov, kl_cov, reinforce, tis,
    topr, kimi15); ``options`` holds its own keys (e.g. ``sapo_temperature_pos``; a ``generator``
    for clip_cov's draw, ``scores`` for topr). A loss that does not take ``importance_sampling`` or
    ``loss_agg_mode`` raises ValueError. Its metrics (``policy_losses`` module docstring) are added,
    each the mean over valid tokens.
    """
    _check_choice("importance_sampling", importance_sampling, list(POLICY_LOSSES))
    _check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    _check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                      response_mask=response_mask)
    mask = bool_mask(response_mask)
    dtype = _compute_dtype(log_probs)
    # Zero garbage advantages under the mask: the backward of -A * ratio would turn a NaN there
    # into a NaN gradient for any registered loss whose ratio is not itself masked.
    advantages = torch.where(mask, advantages.to(dtype), torch.zeros((), dtype=dtype,
                                                                     device=advantages.device))

    get_surrogate(surrogate)
    check_combination(surrogate, importance_sampling, loss_agg_mode)
    terms = get_surrogate(surrogate)(
        log_probs, old_log_probs, advantages, mask, importance_sampling=importance_sampling,
        clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual_clip_c, options=dict(options or {}))
    per_token = terms.loss
    if token_weights is not None:
        _check_same_shape(log_probs=log_probs, token_weights=token_weights)
        # Zeroed off the mask: a NaN there would reach the gradient through the product.
        weights = torch.where(mask, token_weights.detach().to(dtype), torch.zeros((), dtype=dtype,
                                                                                  device=mask.device))
        per_token = per_token * weights
    loss = aggregate_loss(per_token, mask, loss_agg_mode, num_seqs=num_seqs,
                          num_tokens=num_tokens, norm_length=norm_length)

    with torch.no_grad():
        has_tokens = bool(mask.any())
        ratio = terms.ratio.detach()
        metrics = {
            "actor/pg_loss": float(loss.detach()),
            "actor/clipfrac": float(masked_mean(terms.clipped.to(dtype), mask)),
            "actor/dual_clipfrac": float(masked_mean(terms.dual_clipped.to(dtype), mask)),
            "actor/ratio_mean": float(masked_mean(ratio, mask)) if has_tokens else 1.0,
            "actor/ratio_min": float(ratio[mask].min()) if has_tokens else 1.0,
            "actor/ratio_max": float(ratio[mask].max()) if has_tokens else 1.0,
            "actor/ppo_kl": float(masked_mean(
                -token_log_ratio(log_probs.detach(), old_log_probs, mask), mask)),
        }
        metrics.update({key: float(masked_mean(value.detach().to(dtype).expand_as(mask), mask))
                        for key, value in terms.extra.items()})
    return loss, metrics


# --------------------------------------------------------------------------------------------
# KL to the reference policy
# --------------------------------------------------------------------------------------------
def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
               estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || ref)`` from sampled-token log-probs.

    log_probs, ref_log_probs: ``(B, T)``. Returns ``(B, T)`` (unmasked; mask when aggregating).

    * ``k1``: ``logp - ref``                          (unbiased, can be negative)
    * ``k2``: ``0.5 * (logp - ref)^2``
    * ``k3``: ``exp(ref - logp) - (ref - logp) - 1``  (unbiased, >= 0, low variance), with
      ``logp - ref`` clamped to ``[-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND]`` so it stays finite,
      and the value clamped to at most ``K3_VALUE_BOUND`` so its gradient stays small.
    """
    _check_choice("kl estimator", estimator, KL_ESTIMATORS)
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.exp(-log_ratio) + log_ratio - 1.0).clamp(max=K3_VALUE_BOUND)  # k3 >= 0: no lower bound


def kl_loss(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
            estimator: str = "k3", loss_agg_mode: str = "seq-mean-token-mean",
            num_seqs: Optional[Count] = None, num_tokens: Optional[Count] = None,
            norm_length: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """KL loss term ``agg(kl_t)`` (multiply by ``kl_loss_coef`` yourself).

    log_probs (with grad), ref_log_probs, response_mask: ``(B, T)``. Returns ``(loss, metrics)``
    with metrics ``actor/kl_loss`` (the aggregated value) and ``actor/kl_mean`` (token mean).
    Garbage under the mask is zeroed before the estimator so it cannot produce NaN gradients.
    """
    _check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs, response_mask=response_mask)
    mask = bool_mask(response_mask)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    kl = kl_penalty(torch.where(mask, log_probs, zero), torch.where(mask, ref_log_probs.to(
        log_probs.dtype), zero), estimator)
    loss = aggregate_loss(kl, mask, loss_agg_mode, num_seqs=num_seqs, num_tokens=num_tokens,
                          norm_length=norm_length)
    metrics = {"actor/kl_loss": float(loss.detach()),
               "actor/kl_mean": float(masked_mean(kl.detach(), mask))}
    return loss, metrics
