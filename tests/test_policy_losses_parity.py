"""Parity of each policy loss (roll_gspo.algorithms.policy_losses) with an independent reference:
the formula of verl (`verl/trainer/ppo/core_algos.py`), TRL (`trl/trainer/grpo_trainer.py`) or ROLL
(`roll/pipeline/rlvr/actor_pg_worker.py`), re-typed here token by token with Python loops over
the valid positions of each row. float64 random batches with ragged masks and garbage (NaN/inf)
under the padding; every loss_agg_mode the loss takes; value and gradient to 1e-6. Pure torch."""
import math

import pytest
import torch

from roll_gspo.algorithms import LOSS_SPECS, SURROGATES, SYNONYMS, canonical_loss, policy_loss
from roll_gspo.algorithms.losses import LOSS_AGG_MODES
from roll_gspo.schema.config import POLICY_LOSS_CHOICES

B, T, T_NORM = 6, 7, 9
TOL = 1e-6


def make_batch(seed, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 5, 1, 6, 4]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    if per_token_adv:
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    else:
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[1] = 0.0 * adv[1] + 0.7  # a positive row and a negative row for sure
    adv[2] = 0.0 * adv[2] - 0.9
    # garbage under the padding: it must reach neither value nor gradient
    logp = torch.where(mask, logp, torch.full_like(logp, float("nan")))
    old = torch.where(mask, old, torch.full_like(old, float("inf")))
    adv = torch.where(mask, adv, torch.full_like(adv, float("nan")))
    return logp, old, adv, mask


def rows(mask):
    """Per row, the list of its valid positions."""
    return [[t for t in range(T) if mask[i, t]] for i in range(B)]


def ref_aggregate(per_token, mask, mode):
    """per_token[i][t] (scalar tensors) at valid positions -> the scalar loss (docs/gspo.md)."""
    valid = rows(mask)
    nonempty = [i for i in range(B) if valid[i]]
    if mode == "token-mean":
        return sum(per_token[i][t] for i in nonempty for t in valid[i]) / sum(len(v) for v in valid)
    if mode == "seq-mean-token-sum":
        return sum(sum(per_token[i][t] for t in valid[i]) for i in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(per_token[i][t] for t in valid[i]) / len(valid[i]) for i in nonempty) / len(nonempty)
    return sum(per_token[i][t] for i in nonempty for t in valid[i]) / (len(nonempty) * T_NORM)


def clamp(x, lo, hi):
    return torch.clamp(x, min=lo, max=hi)


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


# --------------------------------------------------------------------------------------------
# The references: per_token(lp, old, adv, mask, **options) -> dict (i, t) -> scalar tensor,
# or a full scalar for the losses defined per response (gmpo, luspo)
# --------------------------------------------------------------------------------------------
def ref_ppo_token(lp, old, adv, mask, lo=0.2, hi=0.28):
    out = {}
    for i, valid in enumerate(rows(mask)):
        for t in valid:
            r = torch.exp(lp[i, t] - old[i, t])
            out[i, t] = torch.maximum(-adv[i, t] * r, -adv[i, t] * clamp(r, 1 - lo, 1 + hi))
    return out


def ref_cispo_verl(lp, old, adv, mask, eps_low, eps_high, unified=False):
    """verl compute_policy_loss_cispo (ROLL _compute_cispo_loss with the unified mask)."""
    out = {}
    for i, valid in enumerate(rows(mask)):
        for t in valid:
            r = torch.exp(clamp(lp[i, t] - old[i, t], -20.0, 20.0))
            w = clamp(r, 1 - eps_low, 1 + eps_high).detach()
            value = -w * adv[i, t] * lp[i, t]
            if unified and ((adv[i, t] > 0 and r > 1 + eps_high) or (adv[i, t] < 0 and r < 1 - eps_low)):
                value = value * 0.0
            out[i, t] = value
    return out


def ref_cispo_trl(lp, old, adv, mask, epsilon_high):
    """TRL loss_type cispo (token level): -clamp(coef_1, max=epsilon_high).detach() * A * logp."""
    out = {}
    for i, valid in enumerate(rows(mask)):
        for t in valid:
            coef_1 = torch.exp(lp[i, t] - old[i, t])
            out[i, t] = -torch.clamp(coef_1, max=epsilon_high).detach() * adv[i, t] * lp[i, t]
    return out


def ref_sapo(lp, old, adv, mask, tau_pos, tau_neg, level="token"):
    """verl compute_policy_loss_sapo (token) / TRL loss_type sapo (token or sequence level)."""
    out = {}
    for i, valid in enumerate(rows(mask)):
        seq = sum(lp[i, t] - old[i, t] for t in valid) / len(valid) if valid else None
        for t in valid:
            log_r = seq if level == "seq" else lp[i, t] - old[i, t]
            r = torch.exp(clamp(log_r, -20.0, 20.0))
            tau = tau_pos if adv[i, t] > 0 else tau_neg
            out[i, t] = -sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv[i, t]
    return out


def ref_gmpo(lp, old, adv, mask, lo, hi):
    """verl compute_policy_loss_geo_mean: a mean over responses."""
    losses = []
    for i, valid in enumerate(rows(mask)):
        total = 0.0
        for t in valid:
            log_r = lp[i, t] - old[i, t]
            s = torch.sign(adv[i, t])
            total = total + s * torch.minimum(s * log_r, s * clamp(log_r, -lo, hi))
        ratio = torch.exp(total / len(valid))
        a_mean = sum(adv[i, t] for t in valid) / len(valid)
        losses.append(-a_mean * ratio)
    return sum(losses) / len(losses)


def ref_luspo(lp, old, adv, mask, lo, hi):
    """TRL loss_type luspo, importance_sampling_level sequence: mean_i |y_i| * L_i."""
    losses = []
    for i, valid in enumerate(rows(mask)):
        coef_1 = torch.exp(sum(lp[i, t] - old[i, t] for t in valid) / len(valid))
        coef_2 = clamp(coef_1, 1 - lo, 1 + hi)
        a = adv[i, valid[0]]
        losses.append(-torch.minimum(coef_1 * a, coef_2 * a) * len(valid))
    return sum(losses) / len(losses)


def ref_vespo(lp, old, adv, mask, k_pos, lam_pos, k_neg, lam_neg):
    """TRL get_gamma_weights + loss_type vespo."""
    out = {}
    for i, valid in enumerate(rows(mask)):
        log_w = sum(clamp(lp[i, t] - old[i, t], -20.0, 20.0) for t in valid).detach()
        log_w = clamp(log_w, math.log(1e-8), 20.0)
        for t in valid:
            k, lam = (k_pos, lam_pos) if adv[i, t] >= 0 else (k_neg, lam_neg)
            lam = max(lam, 1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
            out[i, t] = -phi * adv[i, t] * lp[i, t]
    return out


def _covariances(lp, adv, mask):
    valid = [(i, t) for i, v in enumerate(rows(mask)) for t in v]
    a_mean = sum(float(adv[i, t]) for i, t in valid) / len(valid)
    l_mean = sum(float(lp[i, t].detach()) for i, t in valid) / len(valid)
    return valid, {(i, t): (float(adv[i, t]) - a_mean) * (float(lp[i, t].detach()) - l_mean) for i, t in valid}


def ref_clip_cov(lp, old, adv, mask, lo, hi, ratio, lb, ub, seed):
    """verl compute_policy_loss_clip_cov, its random draw from torch.randperm(generator seeded)."""
    base = ref_ppo_token(lp, old, adv, mask, lo, hi)
    valid, cov = _covariances(lp, adv, mask)
    candidates = []
    for i, t in valid:  # row-major, as torch.nonzero lists them
        r = math.exp(float((lp[i, t] - old[i, t]).detach()))
        clipped_by_origin = -float(adv[i, t]) * min(max(r, 1 - lo), 1 + hi) > -float(adv[i, t]) * r
        if not clipped_by_origin and lb < cov[i, t] < ub:
            candidates.append((i, t))
    count = max(int(ratio * len(valid)), 1)
    chosen = set()
    if candidates:
        perm = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))
        chosen = {candidates[j] for j in perm[:count].tolist()}
    return {key: value * 0.0 if key in chosen else value for key, value in base.items()}, chosen


def ref_kl_cov(lp, old, adv, mask, ratio, coef):
    """verl compute_policy_loss_kl_cov."""
    valid, cov = _covariances(lp, adv, mask)
    count = max(1, int(len(valid) * ratio))
    top = set(sorted(valid, key=lambda key: cov[key], reverse=True)[:count])
    out = {}
    for i, t in valid:
        log_r = lp[i, t] - old[i, t]
        out[i, t] = -adv[i, t] * torch.exp(log_r) + (coef * torch.abs(log_r) if (i, t) in top else 0.0)
    return out, top


def ref_reinforce(lp, old, adv, mask):
    """ROLL pg_variant vanilla / verl gpg: -A * logp."""
    return {(i, t): -adv[i, t] * lp[i, t] for i, v in enumerate(rows(mask)) for t in v}


def ref_tis(lp, old, adv, mask, lower, upper):
    return {(i, t): -clamp(torch.exp(lp[i, t] - old[i, t]), lower, upper).detach() * adv[i, t] * lp[i, t]
            for i, v in enumerate(rows(mask)) for t in v}


def ref_topr(lp, old, adv, mask, scores, w_pos, w_neg):
    out = {}
    for i, valid in enumerate(rows(mask)):
        for t in valid:
            if scores[i] > 0:
                out[i, t] = -adv[i, t] * lp[i, t] * w_pos
            else:
                w = clamp(torch.exp(lp[i, t] - old[i, t]), 0.0, 1.0).detach()
                out[i, t] = -w * adv[i, t] * lp[i, t] * w_neg
    return out


def ref_kimi15(lp, old, adv, mask, tau):
    return {(i, t): -adv[i, t] * lp[i, t] + tau * 0.5 * (lp[i, t] - old[i, t]) ** 2
            for i, v in enumerate(rows(mask)) for t in v}


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------
def ours(name, lp, old, adv, mask, agg, level="token", clip=(0.2, 0.28), **options):
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(leaf, old, adv, mask, importance_sampling=level, clip_low=clip[0], clip_high=clip[1],
                                loss_agg_mode=agg, norm_length=T_NORM, surrogate=name, options=options)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def reference(fn, lp, old, adv, mask, agg=None, **kw):
    """The reference's value and gradient (clean inputs: valid entries only)."""
    zero = torch.zeros(())
    leaf = torch.where(mask, lp, zero).clone().requires_grad_(True)
    old_c, adv_c = torch.where(mask, old, zero), torch.where(mask, adv, zero)
    result = fn(leaf, old_c, adv_c, mask, **kw)
    extra = None
    if isinstance(result, tuple):
        result, extra = result
    value = ref_aggregate([[result.get((i, t)) for t in range(T)] for i in range(B)], mask, agg) \
        if isinstance(result, dict) else result
    value.backward()
    return value.detach(), leaf.grad, extra


def assert_same(ours_out, ref_out, mask):
    (value, grad, _), (ref_value, ref_grad, _) = ours_out, ref_out
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert abs(float(value) - float(ref_value)) < TOL, (float(value), float(ref_value))
    assert torch.allclose(grad, ref_grad, atol=TOL, rtol=0), (grad - ref_grad).abs().max()
    assert float(grad[~mask].abs().sum()) == 0.0


SEEDS = [0, 1, 2]
PER_TOKEN = [False, True]


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_adv", PER_TOKEN)
@pytest.mark.parametrize("unified", [False, True])
def test_cispo_equals_verl_and_roll(agg, seed, per_token_adv, unified):
    lp, old, adv, mask = make_batch(seed, per_token_adv)
    got = ours("cispo", lp, old, adv, mask, agg, cispo_epsilon_low=0.15, cispo_epsilon_high=0.1,
               cispo_use_unified_mask=unified)
    assert_same(got, reference(ref_cispo_verl, lp, old, adv, mask, agg, eps_low=0.15, eps_high=0.1, unified=unified),
                mask)
    clipped = [(i, t) for i, v in enumerate(rows(mask)) for t in v
               if not 0.85 <= math.exp(float(lp[i, t] - old[i, t])) <= 1.1]
    assert got[2]["actor/clipfrac"] == pytest.approx(len(clipped) / int(mask.sum()))
    assert 0 < len(clipped) < int(mask.sum())  # the batch exercises both branches


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_in_trl_form(agg, seed):
    """TRL's CISPO has no lower bound and caps the ratio at epsilon_high: eps_low 1, eps_high - 1."""
    lp, old, adv, mask = make_batch(seed)
    got = ours("cispo", lp, old, adv, mask, agg, cispo_epsilon_low=1.0, cispo_epsilon_high=0.2)
    assert_same(got, reference(ref_cispo_trl, lp, old, adv, mask, agg, epsilon_high=1.2), mask)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_adv", PER_TOKEN)
@pytest.mark.parametrize("level", ["token", "seq"])
def test_sapo_equals_verl_and_trl(agg, seed, per_token_adv, level):
    lp, old, adv, mask = make_batch(seed, per_token_adv)
    got = ours("sapo", lp, old, adv, mask, agg, level=level, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    assert_same(got, reference(ref_sapo, lp, old, adv, mask, agg, tau_pos=1.0, tau_neg=1.05, level=level), mask)
    assert 0.0 < got[2]["actor/sapo_gate_mean"] <= 1.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_adv", PER_TOKEN)
def test_gmpo_equals_verl_geo_mean(seed, per_token_adv):
    lp, old, adv, mask = make_batch(seed, per_token_adv)
    got = ours("gmpo", lp, old, adv, mask, "seq-mean-token-mean", level="seq", clip=(0.1, 0.15))
    assert_same(got, reference(ref_gmpo, lp, old, adv, mask, lo=0.1, hi=0.15), mask)
    assert got[2]["actor/gmpo_clipfrac_high"] + got[2]["actor/gmpo_clipfrac_low"] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_luspo_equals_trl(seed):
    lp, old, adv, mask = make_batch(seed)
    got = ours("luspo", lp, old, adv, mask, "seq-mean-token-sum", level="seq", clip=(0.02, 0.03))
    assert_same(got, reference(ref_luspo, lp, old, adv, mask, lo=0.02, hi=0.03), mask)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_adv", PER_TOKEN)
def test_vespo_equals_trl(agg, seed, per_token_adv):
    lp, old, adv, mask = make_batch(seed, per_token_adv)
    shape = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    got = ours("vespo", lp, old, adv, mask, agg, level="seq", **shape)
    assert_same(got, reference(ref_vespo, lp, old, adv, mask, agg, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0),
                mask)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_adv", PER_TOKEN)
def test_clip_cov_equals_verl(agg, seed, per_token_adv):
    lp, old, adv, mask = make_batch(seed, per_token_adv)
    # bounds and share chosen so that some tokens are candidates and some of those are drawn
    kw = dict(clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0)
    got = ours("clip_cov", lp, old, adv, mask, agg, generator=torch.Generator().manual_seed(seed + 10), **kw)
    ref = reference(ref_clip_cov, lp, old, adv, mask, agg, lo=0.2, hi=0.28, ratio=0.1, lb=0.0, ub=5.0, seed=seed + 10)
    assert_same(got, ref, mask)
    assert ref[2] and got[2]["actor/clip_cov_frac"] == pytest.approx(len(ref[2]) / int(mask.sum()))


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_adv", PER_TOKEN)
def test_kl_cov_equals_verl(agg, seed, per_token_adv):
    lp, old, adv, mask = make_batch(seed, per_token_adv)
    got = ours("kl_cov", lp, old, adv, mask, agg, kl_cov_ratio=0.15, kl_cov_coef=0.5)
    ref = reference(ref_kl_cov, lp, old, adv, mask, agg, ratio=0.15, coef=0.5)
    assert_same(got, ref, mask)
    assert got[2]["actor/kl_cov_frac"] == pytest.approx(len(ref[2]) / int(mask.sum()))


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_token_adv", PER_TOKEN)
def test_roll_pg_variants_equal_roll(agg, seed, per_token_adv):
    lp, old, adv, mask = make_batch(seed, per_token_adv)
    assert_same(ours("reinforce", lp, old, adv, mask, agg), reference(ref_reinforce, lp, old, adv, mask, agg), mask)
    assert_same(ours("tis", lp, old, adv, mask, agg, tis_lower_bound=0.9, tis_upper_bound=1.05),
                reference(ref_tis, lp, old, adv, mask, agg, lower=0.9, upper=1.05), mask)
    assert_same(ours("kimi15", lp, old, adv, mask, agg, kimi15_tau=0.3),
                reference(ref_kimi15, lp, old, adv, mask, agg, tau=0.3), mask)
    scores = torch.tensor([1.0, 1.0, 0.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    assert_same(ours("topr", lp, old, adv, mask, agg, scores=scores, topr_positive_weight=1.5,
                     topr_negative_weight=0.5),
                reference(ref_topr, lp, old, adv, mask, agg, scores=scores, w_pos=1.5, w_neg=0.5), mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_topr_without_scores_splits_by_the_advantage_sign(seed):
    """Without ROLL's scores, a response is positive when its advantage is: ROLL's split for 0/1 rewards
    with a group baseline."""
    lp, old, adv, mask = make_batch(seed)
    scores = (torch.where(mask, adv, torch.zeros(())).sum(-1) > 0).to(torch.float64)
    assert_same(ours("topr", lp, old, adv, mask, "token-mean"),
                reference(ref_topr, lp, old, adv, mask, "token-mean", scores=scores, w_pos=1.0, w_neg=1.0), mask)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_clip_is_todays_loss(agg, seed):
    """The default surrogate is the clipped one of before (PPO per token here, against its reference)."""
    lp, old, adv, mask = make_batch(seed)
    assert_same(ours("clip", lp, old, adv, mask, agg), reference(ref_ppo_token, lp, old, adv, mask, agg), mask)
    leaf = lp.clone().requires_grad_(True)
    before, _ = policy_loss(leaf, old, adv, mask, importance_sampling="seq", loss_agg_mode=agg, norm_length=T_NORM)
    after, _ = policy_loss(leaf, old, adv, mask, importance_sampling="seq", loss_agg_mode=agg, norm_length=T_NORM,
                           surrogate="clip")
    assert float(before.detach()) == float(after.detach())


def test_refused_combinations_raise_naming_the_reason():
    lp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="LUSPO"):
        policy_loss(lp, old, adv, mask, importance_sampling="token", loss_agg_mode="seq-mean-token-sum",
                    surrogate="luspo")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(lp, old, adv, mask, importance_sampling="seq", loss_agg_mode="token-mean", surrogate="gmpo")
    with pytest.raises(ValueError, match="Clip-Cov"):
        policy_loss(lp, old, adv, mask, importance_sampling="seq", surrogate="clip_cov")


def test_registry_specs_and_schema_agree():
    assert set(SURROGATES) == set(LOSS_SPECS)
    assert set(POLICY_LOSS_CHOICES) == set(LOSS_SPECS) | set(SYNONYMS)
    assert all(canonical_loss(name) in SURROGATES for name in POLICY_LOSS_CHOICES)


@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_every_loss_is_finite_in_bf16_and_split_invariant(name):
    """Micro-batches with the mini-batch's normalisers sum to the whole batch's loss (the losses
    that select tokens by this call's statistics aside)."""
    spec = LOSS_SPECS[name]
    lp, old, adv, mask = make_batch(3)
    level, agg = spec.ratio_levels[0], spec.agg_modes[-1] if name != "luspo" else "seq-mean-token-sum"
    agg = spec.implied_agg or (agg if agg in spec.agg_modes else spec.agg_modes[0])
    loss, _ = policy_loss(lp.to(torch.bfloat16), old, adv, mask, importance_sampling=level, loss_agg_mode=agg,
                          surrogate=name, clip_low=0.2, clip_high=0.2)
    assert torch.isfinite(loss)
    if name in ("clip_cov", "kl_cov"):
        return
    whole, _ = policy_loss(lp, old, adv, mask, importance_sampling=level, loss_agg_mode=agg, surrogate=name,
                           clip_low=0.2, clip_high=0.2)
    seqs, tokens = float(mask.any(-1).sum()), float(mask.sum())
    parts = sum(policy_loss(lp[s], old[s], adv[s], mask[s], importance_sampling=level, loss_agg_mode=agg,
                            surrogate=name, clip_low=0.2, clip_high=0.2, num_seqs=seqs, num_tokens=tokens)[0]
                for s in (slice(0, 2), slice(2, 6)))
    assert float(parts) == pytest.approx(float(whole), abs=1e-9)
