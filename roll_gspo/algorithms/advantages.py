"""Rewards to advantages, in plain torch.

Shapes: ``B`` responses, ``B = num_prompts * group_size`` with each prompt's ``group_size``
responses in consecutive rows; ``T`` response positions. ``scores`` are ``(B,)``, per-token
tensors ``(B, T)``, ``response_mask`` is 1 (or True) on real response tokens.

Order used by ``compute_advantages`` (as in gspo.md):
normalise rewards -> clip rewards -> token-level rewards (+ optional KL penalty) -> estimator ->
whiten -> clip advantages.

Every standard deviation in this module is the POPULATION one (``unbiased=False``, divide by
``n``): a group of one response then has std 0 (advantage 0) instead of NaN, and a two-response
group with rewards {0, 1} gets advantages of exactly +-1 (up to eps).

A set whose std is at most eps (a group, batch or running window whose rewards are all equal,
e.g. an all-correct group) is DEGENERATE: it has no spread to divide by, so it is never divided by
its std (``1/eps`` would blow its rewards up to ~1e6 and drown the groups that carry signal).
Centred, its values are exactly 0; scaled only (``reward_scale``), they are left unscaled.
Statistics are taken in float64 so that equal values give a mean equal to each of them and a std
of exactly 0.

GDPO (``gdpo_advantages``) is the one exception to the population std: it follows verl's formula,
whose group std and batch variance are the sample ones (Bessel-corrected), so that it equals verl's
estimator value for value.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .losses import bool_mask, masked_mean, masked_sum, registering

__all__ = [
    "REWARD_NORMS",
    "ADV_ESTIMATORS",
    "RunningMeanStd",
    "register_adv_estimator",
    "get_adv_estimator",
    "normalize_rewards",
    "clip_rewards",
    "clip_advantages",
    "token_level_rewards",
    "reinforce_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "gdpo_advantages",
    "reward_component_matrix",
    "whiten",
    "compute_advantages",
    "shaped_token_rewards",
    "finish_advantages",
]

# Same values as roll_gspo.schema.config (a test keeps them in sync); not imported from there so
# that this library needs torch alone.
REWARD_NORMS: List[Optional[str]] = [None, "group", "batch", "running"]


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def _stats(x: torch.Tensor) -> Dict[str, float]:
    """mean / max / min of a 1-D or masked-selected tensor as floats (0 when empty)."""
    if x.numel() == 0:
        return {"mean": 0.0, "max": 0.0, "min": 0.0}
    x = x.detach()
    return {"mean": float(x.mean()), "max": float(x.max()), "min": float(x.min())}


def _check_groups(batch_size: int, group_size: int) -> int:
    """Number of groups; ValueError unless group_size >= 1 divides batch_size."""
    if group_size < 1 or batch_size % group_size != 0:
        raise ValueError(f"batch of {batch_size} responses cannot be split into groups of "
                         f"{group_size}")
    return batch_size // group_size


def _check_rewards_and_mask(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    if token_rewards.dim() != 2 or token_rewards.shape != response_mask.shape:
        raise ValueError(f"token_rewards and response_mask must both be (batch, response_len), got "
                         f"{tuple(token_rewards.shape)} and {tuple(response_mask.shape)}")


# --------------------------------------------------------------------------------------------
# Running statistics
# --------------------------------------------------------------------------------------------
class RunningMeanStd:
    """Running mean and (population) std over every value seen, merged batch by batch.

    Uses the parallel (Chan et al.) merge of (count, mean, M2), so the result equals the mean /
    std of all batches concatenated. State is three python floats: it pickles, ``torch.save``\\ s
    and JSON-serialises, and belongs in checkpoints.
    """

    def __init__(self) -> None:
        self.count: float = 0.0
        self.mean: float = 0.0
        self.var: float = 0.0  # population variance of everything seen

    @property
    def std(self) -> float:
        """Population standard deviation of everything seen (0 before any update)."""
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor) -> None:
        """Merge every element of ``x`` (any shape; empty is a no-op) into the statistics."""
        values = x.detach().reshape(-1).to(torch.float64)
        n = values.numel()
        if n == 0:
            return
        batch_mean = float(values.mean())
        batch_var = float(values.var(unbiased=False))
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    def state_dict(self) -> Dict[str, float]:
        """``{"count", "mean", "var"}`` as python floats."""
        return {"count": float(self.count), "mean": float(self.mean), "var": float(self.var)}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restore from ``state_dict()`` output (ValueError on missing keys)."""
        missing = {"count", "mean", "var"} - set(state)
        if missing:
            raise ValueError(f"RunningMeanStd state lacks {sorted(missing)}")
        self.count = float(state["count"])
        self.mean = float(state["mean"])
        self.var = float(state["var"])

    def __repr__(self) -> str:
        return f"RunningMeanStd(count={self.count:g}, mean={self.mean:g}, std={self.std:g})"


# --------------------------------------------------------------------------------------------
# Reward normalisation and clipping
# --------------------------------------------------------------------------------------------
def normalize_rewards(rewards: torch.Tensor, group_size: int, mode: Optional[str], *,
                      shift: bool = False, scale: bool = False,
                      running: Optional[RunningMeanStd] = None,
                      eps: float = 1e-6) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Normalise response rewards.

    rewards: ``(B,)``. Returns ``(normed (B,), metrics)``.

    mode: ``None`` (returned unchanged), ``"group"`` (mean/std of each run of ``group_size``
    consecutive rewards), ``"batch"`` (whole batch), ``"running"`` (``running`` is first updated
    with this batch, then its mean/std are used; ``running`` is required).
    ``shift`` only: ``r - mean``; ``scale`` only: ``r / (std + eps)``; neither:
    ``(r - mean) / (std + eps)``; both: ValueError. std is the population std.

    A degenerate set (std <= eps, see the module docstring) is not divided by its std: z-score and
    shift give exactly 0 there, scale-only leaves its rewards unchanged. metrics add
    ``critic/reward_norm_degenerate_sets`` (how many sets were left undivided: groups for
    ``group``, 0 or 1 for ``batch`` / ``running``) and, when ``group_size`` divides the batch,
    ``reward/zero_std_groups`` (prompt groups whose raw rewards are all equal; any ``mode``).
    """
    if mode not in REWARD_NORMS:
        raise ValueError(f"unknown reward_norm {mode!r}; valid values: {REWARD_NORMS}")
    if shift and scale:
        raise ValueError("reward_shift and reward_scale are both set: shift only subtracts the "
                         "mean, scale only divides by the std; set one (or neither for a z-score)")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (batch,), got {tuple(rewards.shape)}")
    rewards = rewards.to(_float_dtype(rewards))
    metrics = {"critic/rewards_raw_mean": _stats(rewards)["mean"]}
    if group_size >= 1 and rewards.numel() % group_size == 0:
        raw_groups = rewards.detach().to(torch.float64).view(-1, group_size)
        metrics["reward/zero_std_groups"] = float(
            (raw_groups.std(-1, unbiased=False) <= eps).sum()) if raw_groups.numel() else 0.0
    if mode is None:
        return rewards, metrics

    values = rewards.to(torch.float64)  # exact statistics for equal values (module docstring)
    if mode == "group":
        groups = values.view(_check_groups(values.numel(), group_size), group_size)
        mean = groups.mean(-1, keepdim=True).expand_as(groups).reshape(-1)
        std = groups.std(-1, unbiased=False, keepdim=True).expand_as(groups).reshape(-1)
        degenerate_sets = int((groups.std(-1, unbiased=False) <= eps).sum())
    elif mode == "batch":
        mean = values.mean() if values.numel() else values.new_zeros(())
        std = values.std(unbiased=False) if values.numel() else values.new_zeros(())
        degenerate_sets = int(values.numel() > 0 and float(std) <= eps)
    else:  # running
        if running is None:
            raise ValueError("reward_norm 'running' needs a RunningMeanStd (running=...)")
        running.update(rewards)
        mean = torch.tensor(running.mean, dtype=torch.float64, device=rewards.device)
        std = torch.tensor(running.std, dtype=torch.float64, device=rewards.device)
        metrics["critic/reward_running_count"] = float(running.count)
        degenerate_sets = int(running.std <= eps)

    degenerate = std <= eps
    centred = torch.where(degenerate, torch.zeros_like(values), values - mean)
    divisor = torch.where(degenerate, torch.ones_like(std), std + eps)
    if shift:
        normed = centred
    elif scale:
        normed = values / divisor
    else:
        normed = centred / divisor
    metrics["critic/reward_norm_mean"] = float(mean.float().mean()) if mean.numel() else 0.0
    metrics["critic/reward_norm_std"] = float(std.float().mean()) if std.numel() else 0.0
    metrics["critic/reward_norm_degenerate_sets"] = float(degenerate_sets)
    return normed.to(rewards.dtype), metrics


def clip_rewards(rewards: torch.Tensor,
                 reward_clip: Optional[float]) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Clamp rewards to ``[-reward_clip, reward_clip]`` (``None``: unchanged).

    rewards: any shape (typically ``(B,)``). Returns ``(clipped, {"critic/reward_clipfrac"})``.
    """
    if reward_clip is None:
        return rewards, {"critic/reward_clipfrac": 0.0}
    if not reward_clip > 0:
        raise ValueError(f"reward_clip must be > 0, got {reward_clip}")
    clipped = rewards.clamp(-reward_clip, reward_clip)
    frac = float((clipped != rewards).float().mean()) if rewards.numel() else 0.0
    return clipped, {"critic/reward_clipfrac": frac}


def clip_advantages(advantages: torch.Tensor, response_mask: torch.Tensor,
                    advantage_clip: Optional[float]) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Clamp advantages to ``[-advantage_clip, advantage_clip]`` (``None``: unchanged).

    advantages, response_mask: ``(B, T)``. Returns ``(clipped (B, T), metrics)`` with
    ``critic/advantage_clipfrac``, the fraction of valid tokens changed by the clamp.
    """
    if advantage_clip is None:
        return advantages, {"critic/advantage_clipfrac": 0.0}
    if not advantage_clip > 0:
        raise ValueError(f"advantage_clip must be > 0, got {advantage_clip}")
    clipped = advantages.clamp(-advantage_clip, advantage_clip)
    frac = float(masked_mean((clipped != advantages).to(_float_dtype(advantages)), response_mask))
    return clipped, {"critic/advantage_clipfrac": frac}


def token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor, *,
                        kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Place each response's score on its last valid token, minus ``kl_coef * kl`` per token.

    scores: ``(B,)``; response_mask, kl: ``(B, T)``. Returns ``(B, T)``, 0 outside the mask.
    A row with no valid token has nowhere to hold its score and stays 0.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be (batch,) and response_mask (batch, response_len), got "
                         f"{tuple(scores.shape)} and {tuple(response_mask.shape)}")
    mask = bool_mask(response_mask)
    dtype = _float_dtype(scores)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last_valid = torch.where(mask, positions, torch.full_like(positions, -1)).max(-1).values  # (B,)
    is_last = (positions == last_valid.unsqueeze(-1)) & mask
    rewards = torch.where(is_last, scores.to(dtype).unsqueeze(-1), torch.zeros((), dtype=dtype,
                                                                              device=scores.device))
    if kl is not None:
        if kl.shape != mask.shape:
            raise ValueError(f"kl must be {tuple(mask.shape)}, got {tuple(kl.shape)}")
        rewards = rewards - kl_coef * torch.where(mask, kl.to(dtype), torch.zeros(
            (), dtype=dtype, device=kl.device))
    return rewards


# --------------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------------
AdvEstimatorFn = Callable[..., torch.Tensor]
ADV_ESTIMATORS: Dict[str, AdvEstimatorFn] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator under ``name`` (its facts, which pipelines take
    it and whether it needs a critic, are declared in `roll_gspo.catalog.estimators`).

    The function is ``fn(token_rewards (B, T), response_mask (B, T), group_size, eps=1e-6)`` and
    returns ``(B, T)`` advantages, 0 outside the mask.
    """
    return registering(ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator(name: str) -> AdvEstimatorFn:
    """The estimator registered as ``name``; ValueError listing the valid names."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {name!r}; valid values: {list(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def _broadcast_over_tokens(per_response: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` -> ``(B, T)`` on valid tokens, 0 elsewhere."""
    return torch.where(bool_mask(response_mask), per_response.unsqueeze(-1),
                       torch.zeros((), dtype=per_response.dtype, device=per_response.device))


@register_adv_estimator("reinforce")
def reinforce_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                         group_size: int = 1, eps: float = 1e-6) -> torch.Tensor:
    """Reward-to-go with gamma 1: ``A_t = sum_{t' >= t} m_t' r_t'``, no baseline.

    token_rewards, response_mask: ``(B, T)``. Returns ``(B, T)``, 0 outside the mask. With only
    the final-token reward every valid token gets the response's reward. group_size and eps are
    unused (the signature is the registry's).
    """
    _check_rewards_and_mask(token_rewards, response_mask)
    masked = torch.where(bool_mask(response_mask), token_rewards,
                         torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device))
    returns = masked.flip(-1).cumsum(-1).flip(-1)
    return torch.where(bool_mask(response_mask), returns, torch.zeros_like(returns))


@register_adv_estimator("grpo")
def grpo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group z-score: ``(r_i - mean_group) / (std_group + eps)`` with the population std.

    token_rewards, response_mask: ``(B, T)``; ``r_i`` is the sum of row i's valid token rewards.
    Returns ``(B, T)``: the response's value on each valid token, 0 elsewhere. A degenerate group
    (std <= eps: all rewards equal) gets exactly 0, not its rounding noise divided by eps.
    """
    _check_rewards_and_mask(token_rewards, response_mask)
    num_groups = _check_groups(token_rewards.shape[0], group_size)
    scores = masked_sum(token_rewards, response_mask, dim=-1).view(num_groups, group_size)
    values = scores.to(torch.float64)
    mean = values.mean(-1, keepdim=True)
    std = values.std(-1, unbiased=False, keepdim=True)
    zscore = torch.where(std <= eps, torch.zeros_like(values), (values - mean) / (std + eps))
    return _broadcast_over_tokens(zscore.to(scores.dtype).reshape(-1), response_mask)


@register_adv_estimator("rloo")
def rloo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int,
                    eps: float = 1e-6) -> torch.Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j`` within the group (group_size >= 2).

    token_rewards, response_mask: ``(B, T)``; ``r_i`` is the sum of row i's valid token rewards.
    Returns ``(B, T)``: the response's value on each valid token, 0 elsewhere. eps is unused.
    """
    _check_rewards_and_mask(token_rewards, response_mask)
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    num_groups = _check_groups(token_rewards.shape[0], group_size)
    scores = masked_sum(token_rewards, response_mask, dim=-1).view(num_groups, group_size)
    baseline = (scores.sum(-1, keepdim=True) - scores) / (group_size - 1)
    return _broadcast_over_tokens((scores - baseline).reshape(-1), response_mask)


@register_adv_estimator("gdpo")
def gdpo_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int,
                    eps: float = 1e-6, *, components: Optional[torch.Tensor] = None,
                    weights: Optional[Sequence[float]] = None) -> torch.Tensor:
    """GDPO (Group reward-Decoupled normalisation, arXiv 2601.05242; verl's and NeMo-RL's ``gdpo``):
    each reward component is z-scored within its group on its own, the z-scores are summed with
    ``weights``, and the sum is whitened over the batch's valid tokens. Summing first (GRPO) lets the
    component with the larger spread decide every advantage; here a correctness and a format
    reward each count by their weight, whatever their scales.

    components: ``(B, K)``, response i's K named reward parts (``reward_component_matrix``);
    weights: K numbers (None: all 1); response_mask: ``(B, T)``. Returns ``(B, T)``, 0 outside the
    mask. ``token_rewards`` (the combined score) is not read: the components stand for it.

    As verl: the group std is the sample one, ``(r - mean) / (std + eps)`` per component, and the
    batch whitening is ``(A - mean) / sqrt(var + 1e-8)`` with the sample variance over valid tokens
    (a long response weighs more, as there). A component equal across its group gives that group
    exactly 0 (the module's degenerate-set rule; verl's value there is 0 as well, up to its float32
    rounding). A batch of one valid token keeps its population variance (verl divides by zero).
    """
    _check_rewards_and_mask(token_rewards, response_mask)
    if components is None:
        raise ValueError("adv_estimator 'gdpo' needs the responses' reward components (components=(B, K)); "
                         "a single combined reward has none to normalise apart")
    if components.dim() != 2 or components.shape[0] != token_rewards.shape[0] or components.shape[1] < 1:
        raise ValueError(f"components must be (batch, K >= 1), got {tuple(components.shape)} for a batch of "
                         f"{token_rewards.shape[0]}")
    if group_size < 2:
        raise ValueError(f"gdpo needs group_size >= 2 (a group baseline per component), got {group_size}")
    num_groups = _check_groups(token_rewards.shape[0], group_size)
    num_parts = components.shape[1]
    weight = torch.tensor([1.0] * num_parts if weights is None else list(weights), dtype=torch.float64,
                          device=components.device)
    if weight.numel() != num_parts:
        raise ValueError(f"gdpo: {weight.numel()} weights for {num_parts} reward components")

    values = components.to(torch.float64).view(num_groups, group_size, num_parts)
    mean = values.mean(1, keepdim=True)
    std = values.std(1, unbiased=True, keepdim=True)
    zscore = torch.where(std <= eps, torch.zeros_like(values), (values - mean) / (std + eps))
    combined = (zscore * weight).sum(-1).reshape(-1)  # (B,)
    dtype = _float_dtype(token_rewards)
    spread = _broadcast_over_tokens(combined, response_mask)
    return whiten(spread, response_mask, unbiased=True).to(dtype)


def reward_component_matrix(row_metrics: Sequence[Optional[Mapping[str, float]]], keys: Sequence[str], *,
                            statuses: Optional[Sequence[str]] = None,
                            domains: Optional[Sequence[str]] = None) -> torch.Tensor:
    """The ``(B, K)`` GDPO components of a scored batch: ``row_metrics[i][key]`` for each key.

    row_metrics: the reward workers' named numbers per response (``reward_metrics``). A response
    scored without its worker's scorer (status ``format``, ``error`` or ``timeout``: its score is
    0 and it carries no numbers) has every component 0. A scored response (``ok``) missing a key is
    a ValueError naming the key and its domain: its worker does not send that component.
    """
    statuses = list(statuses) if statuses is not None else ["ok"] * len(row_metrics)
    domains = list(domains) if domains is not None else ["?"] * len(row_metrics)
    rows = []
    for i, (named, status) in enumerate(zip(row_metrics, statuses)):
        if named is None and status != "ok":
            rows.append([0.0] * len(keys))
            continue
        values = named or {}
        missing = [k for k in keys if k not in values]
        if missing:
            raise ValueError(f"adv_estimator gdpo: response {i} (domain {domains[i]!r}) has no reward component "
                             f"{missing} (its worker sent {sorted(values) or 'none'}); gdpo_reward_keys must name "
                             f"numbers every reward worker reports per response")
        rows.append([float(values[k]) for k in keys])
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(keys))


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, *, unbiased: bool = False) -> torch.Tensor:
    """Masked z-score over the whole batch: ``(x - mean) / sqrt(var + eps)``, population variance
    (``unbiased``: the sample variance, n / (n - 1) times it, as verl's ``masked_whiten``; with one
    valid value it stays the population one).

    values, mask: ``(B, T)``. Returns ``(B, T)``, 0 outside the mask. eps sits inside the square
    root and the statistics are float64, so a batch whose valid values are all equal whitens to
    exactly 0 (with eps outside, its rounding noise over eps gave a constant push of ~0.9).
    """
    wide = values.to(torch.float64)
    mean = masked_mean(wide, mask)
    var = masked_mean((wide - mean).square(), mask)
    count = float(bool_mask(mask).sum())
    if unbiased and count > 1:
        var = var * count / (count - 1)
    whitened = ((wide - mean) / torch.sqrt(var + eps)).to(values.dtype)
    return torch.where(bool_mask(mask), whitened, torch.zeros((), dtype=whitened.dtype,
                                                               device=whitened.device))


# --------------------------------------------------------------------------------------------
# The whole chain
# --------------------------------------------------------------------------------------------
def compute_advantages(scores: torch.Tensor, response_mask: torch.Tensor, *, group_size: int,
                       adv_estimator: str, reward_norm: Optional[str] = None,
                       reward_shift: bool = False, reward_scale: bool = False,
                       reward_clip: Optional[float] = None,
                       running_stats: Optional[RunningMeanStd] = None,
                       kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                       whiten_advantages: bool = False, advantage_clip: Optional[float] = None,
                       reward_components: Optional[torch.Tensor] = None,
                       component_weights: Optional[Sequence[float]] = None,
                       eps: float = 1e-6) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Scores to per-token advantages.

    scores: ``(B,)`` (consecutive groups of ``group_size``); response_mask, kl: ``(B, T)``.
    Returns ``(advantages (B, T), metrics)``, advantages 0 outside the mask.

    Steps: ``normalize_rewards(reward_norm, reward_shift, reward_scale, running_stats)`` ->
    ``clip_rewards(reward_clip)`` -> ``token_level_rewards`` (score on the last token, minus
    ``kl_coef * kl`` per token when ``kl`` is given, e.g. ``old_logp - ref_logp``) ->
    ``ADV_ESTIMATORS[adv_estimator]`` -> ``whiten`` (if ``whiten_advantages``) ->
    ``clip_advantages(advantage_clip)``. An estimator of reward components (``gdpo``) is given
    ``reward_components`` ``(B, K)`` and ``component_weights`` (K numbers) too.

    metrics: ``critic/score_mean|max|min`` (raw), ``critic/rewards_normed_mean`` (after
    normalisation and reward clip), ``critic/advantages_mean|max|min`` (final, valid tokens),
    ``critic/returns_mean`` (estimator output, valid tokens), clip fractions, the normaliser's
    statistics and, with ``kl``, ``critic/kl_penalty_mean``.
    """
    estimator = get_adv_estimator(adv_estimator)
    token_rewards, metrics = shaped_token_rewards(
        scores, response_mask, group_size=group_size, reward_norm=reward_norm, reward_shift=reward_shift,
        reward_scale=reward_scale, reward_clip=reward_clip, running_stats=running_stats, kl=kl, kl_coef=kl_coef,
        eps=eps)
    mask = bool_mask(response_mask)
    extra = {} if reward_components is None else {"components": reward_components, "weights": component_weights}
    advantages = estimator(token_rewards, mask, group_size, eps=eps, **extra)
    metrics["critic/returns_mean"] = float(masked_mean(advantages, mask))
    return finish_advantages(advantages, mask, metrics, whiten_advantages=whiten_advantages,
                             advantage_clip=advantage_clip)


def shaped_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor, *, group_size: int,
                         reward_norm: Optional[str] = None, reward_shift: bool = False, reward_scale: bool = False,
                         reward_clip: Optional[float] = None, running_stats: Optional[RunningMeanStd] = None,
                         kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                         eps: float = 1e-6) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The first steps of ``compute_advantages``: scores ``(B,)`` -> normalised, clipped rewards
    on each response's last token, minus ``kl_coef * kl`` per token. Returns ``(token_rewards
    (B, T), metrics)``."""
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be (batch,) and response_mask (batch, response_len), got "
                         f"{tuple(scores.shape)} and {tuple(response_mask.shape)}")
    mask = bool_mask(response_mask)
    metrics: Dict[str, float] = {}
    for key, value in _stats(scores.to(_float_dtype(scores))).items():
        metrics[f"critic/score_{key}"] = value

    rewards, norm_metrics = normalize_rewards(scores, group_size, reward_norm, shift=reward_shift,
                                              scale=reward_scale, running=running_stats, eps=eps)
    metrics.update(norm_metrics)
    rewards, clip_metrics = clip_rewards(rewards, reward_clip)
    metrics.update(clip_metrics)
    metrics["critic/rewards_normed_mean"] = _stats(rewards)["mean"]

    token_rewards = token_level_rewards(rewards, mask, kl=kl, kl_coef=kl_coef)
    if kl is not None:
        metrics["critic/kl_penalty_mean"] = float(masked_mean(kl.detach().to(rewards.dtype), mask))
    return token_rewards, metrics


def finish_advantages(advantages: torch.Tensor, mask: torch.Tensor, metrics: Dict[str, float], *,
                      whiten_advantages: bool = False,
                      advantage_clip: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The last steps of ``compute_advantages``: whiten, clip, and the advantage statistics added
    to ``metrics``. advantages, mask: ``(B, T)``."""
    if whiten_advantages:
        advantages = whiten(advantages, mask)
    advantages, adv_clip_metrics = clip_advantages(advantages, mask, advantage_clip)
    metrics.update(adv_clip_metrics)

    for key, value in _stats(advantages.detach()[mask]).items():
        metrics[f"critic/advantages_{key}"] = value
    return advantages.detach(), metrics
