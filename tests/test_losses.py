"""Tests of roll_gspo.algorithms.losses: ratios, clipped surrogate, aggregation, KL."""
import math
import subprocess
import sys

import pytest
import torch

from roll_gspo.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    compute_importance_ratio,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
)

DT = torch.float64
WIDE = dict(clip_low=0.99, clip_high=100.0)  # nothing clips


def mask_from_lengths(lengths, width):
    """(B, width) float mask, right padded."""
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(DT)


def random_batch(lengths, width=None, seed=0, spread=0.05):
    """log_probs (leaf, requires grad), old_log_probs, per-response advantages, mask."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    mask = mask_from_lengths(lengths, width)
    logp = (-torch.rand(len(lengths), width, generator=g, dtype=DT) * 2).requires_grad_()
    old = logp.detach() + spread * torch.randn(len(lengths), width, generator=g, dtype=DT)
    adv = torch.randn(len(lengths), 1, generator=g, dtype=DT).expand(-1, width).clone()
    return logp, old, adv, mask


def grad_of(loss, leaf):
    (g,) = torch.autograd.grad(loss, leaf)
    return g


# --------------------------------------------------------------------------------------------
# Ratios and GSPO gradient
# --------------------------------------------------------------------------------------------
def test_seq_ratio_is_length_normalised_geometric_mean():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 9.0, 9.0]], dtype=DT)
    old = torch.tensor([[-1.1, -2.3, -2.9], [-0.7, 0.0, 0.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=DT)
    ratio = compute_importance_ratio(logp, old, mask, "seq")
    s0 = math.exp((0.1 + 0.3 - 0.1) / 3)
    s1 = math.exp(0.2)
    torch.testing.assert_close(ratio, torch.tensor([[s0, s0, s0], [s1, 1.0, 1.0]], dtype=DT))
    token = compute_importance_ratio(logp, old, mask, "token")
    torch.testing.assert_close(token[0], torch.exp(logp[0] - old[0]))


def test_gspo_gradient_equals_closed_form():
    lengths = [4, 2, 5, 3]
    logp, old, adv, mask = random_batch(lengths, width=6, seed=1)
    loss, _ = policy_loss(logp, old, adv, mask, importance_sampling="seq",
                          loss_agg_mode="seq-mean-token-mean", **WIDE)
    grad = grad_of(loss, logp)

    lens = mask.sum(-1)
    s = torch.exp(((logp.detach() - old) * mask).sum(-1) / lens)
    expected = -(s * adv[:, 0] / lens)[:, None] * mask / len(lengths)
    torch.testing.assert_close(grad, expected)


def test_gspo_gradient_closed_form_through_a_model():
    # logp comes from parameters, so the check covers the chain rule into a model too.
    g = torch.Generator().manual_seed(2)
    batch, width, vocab = 3, 5, 7
    logits = torch.randn(batch, width, vocab, generator=g, dtype=DT, requires_grad=True)
    tokens = torch.randint(vocab, (batch, width), generator=g)
    mask = mask_from_lengths([5, 3, 1], width)
    old = torch.log_softmax(logits.detach(), -1).gather(-1, tokens[..., None])[..., 0]
    old = old + 0.03 * torch.randn(batch, width, generator=g, dtype=DT)
    adv = torch.tensor([[1.5], [-0.7], [0.4]], dtype=DT).expand(-1, width)

    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    loss, _ = policy_loss(logp, old, adv, mask, importance_sampling="seq", **WIDE)
    grad = grad_of(loss, logits)

    # Closed form: -(1/B) sum_i s_i A_i (1/|y_i|) sum_t grad logp_i,t, s_i held constant.
    lens = mask.sum(-1)
    s = torch.exp(((logp.detach() - old) * mask).sum(-1) / lens)
    weights = (s * adv[:, 0] / lens)[:, None] * mask
    logp_again = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    surrogate = -(weights * logp_again).sum() / batch
    torch.testing.assert_close(grad, grad_of(surrogate, logits))


def test_gspo_gradient_zero_for_responses_clipped_in_direction_of_advantage():
    width = 4
    logp = torch.full((4, width), -1.0, dtype=DT, requires_grad=True)
    mask = torch.ones(4, width, dtype=DT)
    # Per-row mean log ratio: +0.01 (ratio ~1.01 > 1 + 4e-4) or -0.01 (ratio ~0.99 < 1 - 3e-4).
    shift = torch.tensor([0.01, -0.01, -0.01, 0.01], dtype=DT)[:, None]
    wiggle = torch.tensor([0.02, -0.02, 0.01, -0.01], dtype=DT)[None, :]  # zero mean per row
    old = logp.detach() - shift + wiggle
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=DT)[:, None].expand(-1, width)
    loss, metrics = policy_loss(logp, old, adv, mask, importance_sampling="seq",
                                clip_low=3e-4, clip_high=4e-4)
    grad = grad_of(loss, logp)
    # Rows 0 (ratio high, A > 0) and 1 (ratio low, A < 0) are clipped: no gradient.
    assert torch.all(grad[:2] == 0)
    # Rows 2 and 3 move against their advantage: the unclipped branch, the closed-form gradient.
    s = torch.exp(((logp.detach() - old) * mask).sum(-1) / width)
    expected = -(s * adv[:, 0] / width)[:, None] * mask / 4
    torch.testing.assert_close(grad[2:], expected[2:])
    assert metrics["actor/clipfrac"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_seq_and_gspo_token_agree_for_per_response_advantages(mode):
    logp, old, adv, mask = random_batch([5, 3, 6, 1], width=7, seed=7, spread=0.02)
    kwargs = dict(clip_low=3e-3, clip_high=4e-3, loss_agg_mode=mode, norm_length=8)
    loss_seq, m_seq = policy_loss(logp, old, adv, mask, importance_sampling="seq", **kwargs)
    loss_tok, m_tok = policy_loss(logp, old, adv, mask, importance_sampling="gspo-token", **kwargs)
    assert 0 < m_seq["actor/clipfrac"] < 1  # both branches exercised
    assert m_seq["actor/clipfrac"] == m_tok["actor/clipfrac"]
    torch.testing.assert_close(loss_seq, loss_tok)
    torch.testing.assert_close(grad_of(loss_seq, logp), grad_of(loss_tok, logp))


def test_gspo_token_gradient_differs_from_seq_when_advantages_vary_along_response():
    logp, old, _, mask = random_batch([5, 4], width=5, seed=4, spread=0.01)
    adv = torch.randn(2, 5, generator=torch.Generator().manual_seed(5), dtype=DT)
    loss_seq, _ = policy_loss(logp, old, adv, mask, importance_sampling="seq", **WIDE)
    loss_tok, _ = policy_loss(logp, old, adv, mask, importance_sampling="gspo-token", **WIDE)
    torch.testing.assert_close(loss_seq, loss_tok)  # same value
    # gspo-token: each token weighted by its own advantage.
    s = torch.exp(((logp.detach() - old) * mask).sum(-1) / mask.sum(-1))
    expected = -(s[:, None] * adv * mask) / mask.sum(-1, keepdim=True) / 2
    torch.testing.assert_close(grad_of(loss_tok, logp), expected)
    assert not torch.allclose(grad_of(loss_seq, logp), expected)


def test_token_mode_matches_hand_ppo_formula():
    logp, old, _, mask = random_batch([4, 2, 3], width=4, seed=6, spread=0.3)
    adv = torch.randn(3, 4, generator=torch.Generator().manual_seed(7), dtype=DT)
    clip_low, clip_high = 0.2, 0.28
    loss, metrics = policy_loss(logp, old, adv, mask, importance_sampling="token",
                                clip_low=clip_low, clip_high=clip_high, loss_agg_mode="token-mean")

    total, n_valid, n_clipped = 0.0, 0, 0
    expected_grad = torch.zeros_like(mask)
    for i in range(3):
        for t in range(4):
            if mask[i, t] == 0:
                continue
            r = math.exp(float(logp[i, t].detach() - old[i, t]))
            a = float(adv[i, t])
            unclipped, clipped = -r * a, -min(max(r, 1 - clip_low), 1 + clip_high) * a
            n_valid += 1
            if clipped > unclipped:
                total += clipped
                n_clipped += 1
            else:
                total += unclipped
                expected_grad[i, t] = -r * a  # d(-r a)/d logp
    assert 0 < n_clipped < n_valid
    assert loss.item() == pytest.approx(total / n_valid, rel=1e-12)
    torch.testing.assert_close(grad_of(loss, logp), expected_grad / n_valid)
    assert metrics["actor/clipfrac"] == pytest.approx(n_clipped / n_valid)


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------
def test_aggregate_loss_hand_values():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=DT)
    assert float(aggregate_loss(loss_mat, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-mean")) == \
        pytest.approx((2 + 4) / 2)
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm")) == pytest.approx(
        10 / (2 * 3))
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_length=10)) == \
        pytest.approx(10 / (2 * 10))
    # Global denominators replace the local ones.
    assert float(aggregate_loss(loss_mat, mask, "token-mean", num_tokens=8)) == \
        pytest.approx(10 / 8)
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-mean", num_seqs=4)) == \
        pytest.approx(6 / 4)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_numerators_ignore_garbage(mode):
    logp, old, adv, mask = random_batch([3, 5, 2], width=5, seed=8, spread=0.1)
    clean, _ = policy_loss(logp, old, adv, mask, importance_sampling="seq", loss_agg_mode=mode,
                           clip_low=0.05, clip_high=0.05)
    clean_grad = grad_of(clean, logp)

    pad = mask == 0
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4, -1e4], dtype=DT)
    fill = garbage[torch.arange(int(pad.sum())) % len(garbage)]
    logp_g = logp.detach().clone()
    logp_g[pad] = fill
    logp_g.requires_grad_()
    old_g, adv_g = old.clone(), adv.clone()
    old_g[pad] = fill.flip(0)
    adv_g[pad] = fill
    dirty, _ = policy_loss(logp_g, old_g, adv_g, mask, importance_sampling="seq",
                           loss_agg_mode=mode, clip_low=0.05, clip_high=0.05)
    dirty_grad = grad_of(dirty, logp_g)
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(dirty_grad, clean_grad)
    assert torch.all(dirty_grad[pad] == 0)

    # aggregate_loss alone: garbage losses under the mask do not count.
    loss_mat = torch.where(pad, torch.tensor(float("nan"), dtype=DT), adv)
    torch.testing.assert_close(aggregate_loss(loss_mat, mask, mode),
                               aggregate_loss(torch.where(pad, 0.0, adv), mask, mode))


@pytest.mark.parametrize("importance_sampling", ["seq", "token", "gspo-token"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_invariance(mode, importance_sampling):
    logp, old, adv, mask = random_batch([4, 2, 3], width=4, seed=9, spread=0.1)
    kwargs = dict(importance_sampling=importance_sampling, loss_agg_mode=mode, norm_length=16,
                  clip_low=0.05, clip_high=0.05)
    loss, _ = policy_loss(logp, old, adv, mask, **kwargs)
    grad = grad_of(loss, logp)

    extra = 3
    def pad(x, value):
        return torch.cat([x, torch.full((x.shape[0], extra), value, dtype=DT)], dim=1)
    logp_p = pad(logp.detach(), 7.0).requires_grad_()
    loss_p, _ = policy_loss(logp_p, pad(old, -7.0), pad(adv, 3.0), pad(mask, 0.0), **kwargs)
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(grad_of(loss_p, logp_p)[:, :4], grad)


def test_default_norm_length_is_padded_width():
    loss_mat = torch.ones(2, 4, dtype=DT)
    mask = torch.ones(2, 4, dtype=DT)
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm")) == pytest.approx(1.0)
    padded_mat, padded_mask = torch.ones(2, 8, dtype=DT), torch.cat([mask, torch.zeros(2, 4)], 1)
    assert float(aggregate_loss(padded_mat, padded_mask, "seq-mean-token-sum-norm")) == \
        pytest.approx(0.5)


@pytest.mark.parametrize("importance_sampling", ["seq", "token"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_invariance(mode, importance_sampling):
    lengths = [6, 2, 4, 0, 5, 3, 1]
    logp, old, adv, mask = random_batch(lengths, width=6, seed=10, spread=0.1)
    kwargs = dict(importance_sampling=importance_sampling, loss_agg_mode=mode, norm_length=6,
                  clip_low=0.05, clip_high=0.05)
    full, _ = policy_loss(logp, old, adv, mask, **kwargs)
    full_grad = grad_of(full, logp)

    num_seqs = int((mask.sum(-1) > 0).sum())
    num_tokens = int(mask.sum())
    total = 0.0
    for rows in ([0, 1, 2], [3, 4], [5, 6]):
        # Each micro-batch is trimmed to its own longest response, as a collator would pad it.
        width = max(max(lengths[r] for r in rows), 1)
        part, _ = policy_loss(logp[rows, :width], old[rows, :width], adv[rows, :width],
                              mask[rows, :width], num_seqs=num_seqs, num_tokens=num_tokens,
                              **kwargs)
        total = total + part
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(grad_of(total, logp), full_grad)

    # Without the global denominators the sum is not the mini-batch loss (the test can fail).
    local = sum(policy_loss(logp[rows], old[rows], adv[rows], mask[rows], **kwargs)[0]
                for rows in ([0, 1, 2], [3, 4], [5, 6]))
    assert not torch.allclose(local, full)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_rows_are_excluded(mode):
    logp, old, adv, mask = random_batch([3, 4], width=4, seed=11, spread=0.1)
    loss, _ = policy_loss(logp, old, adv, mask, loss_agg_mode=mode, clip_low=0.05, clip_high=0.05)
    empty = torch.zeros(1, 4, dtype=DT)
    logp_e = torch.cat([logp.detach(), empty - 1.0]).requires_grad_()
    loss_e, metrics = policy_loss(logp_e, torch.cat([old, empty]), torch.cat([adv, empty + 5.0]),
                                  torch.cat([mask, empty]), loss_agg_mode=mode, clip_low=0.05,
                                  clip_high=0.05)
    torch.testing.assert_close(loss_e, loss)
    assert torch.all(grad_of(loss_e, logp_e)[2] == 0)
    assert math.isfinite(metrics["actor/ratio_mean"])


def test_all_masked_batch_gives_zero_loss():
    logp = torch.zeros(2, 3, dtype=DT, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=DT)
    for mode in LOSS_AGG_MODES:
        loss, metrics = policy_loss(logp, logp.detach(), torch.ones(2, 3, dtype=DT), mask,
                                    loss_agg_mode=mode)
        assert loss.item() == 0.0 and metrics["actor/clipfrac"] == 0.0


# --------------------------------------------------------------------------------------------
# Clip metrics, dual clip
# --------------------------------------------------------------------------------------------
def test_clipfrac_and_ratio_metrics_hand_case():
    # token mode, clip 0.2: (ratio, A) -> clipped?
    ratios = [1.5, 0.5, 1.5, 0.5, 1.0, 1.5, 3.0]
    advs = [1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 1.0]
    valid = [1, 1, 1, 1, 1, 1, 0]  # the last (would-be clipped) token is padding
    logp = torch.tensor([ratios], dtype=DT).log()
    old = torch.zeros_like(logp)
    _, metrics = policy_loss(logp, old, torch.tensor([advs], dtype=DT),
                             torch.tensor([valid], dtype=DT), importance_sampling="token",
                             clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean")
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 6)
    assert metrics["actor/ratio_max"] == pytest.approx(1.5)
    assert metrics["actor/ratio_min"] == pytest.approx(0.5)
    assert metrics["actor/ratio_mean"] == pytest.approx(sum(ratios[:6]) / 6)
    assert metrics["actor/dual_clipfrac"] == 0.0


def test_dual_clip_hand_case():
    # (ratio, A): (5, -1) -> min(5, 3) = 3 capped; (2, -1) -> 2 (< 3); (5, +1) -> -1.28 (clip).
    logp = torch.tensor([[5.0, 2.0, 5.0]], dtype=DT).log().requires_grad_()
    old = torch.zeros(1, 3, dtype=DT)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=DT)
    mask = torch.ones(1, 3, dtype=DT)
    kwargs = dict(importance_sampling="token", clip_low=0.2, clip_high=0.28,
                  loss_agg_mode="seq-mean-token-sum")
    loss, metrics = policy_loss(logp, old, adv, mask, dual_clip_c=3.0, **kwargs)
    assert loss.item() == pytest.approx(3.0 + 2.0 - 1.28)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, 2.0, 0.0]], dtype=DT))
    assert metrics["actor/dual_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["actor/clipfrac"] == pytest.approx(1 / 3)

    no_dual, _ = policy_loss(logp, old, adv, mask, **kwargs)
    assert no_dual.item() == pytest.approx(5.0 + 2.0 - 1.28)
    for bad_c in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip_c"):
            policy_loss(logp, old, adv, mask, dual_clip_c=bad_c, **kwargs)


# --------------------------------------------------------------------------------------------
# KL, entropy, helpers, names
# --------------------------------------------------------------------------------------------
def test_kl_estimators_hand_values():
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], dtype=DT)
    ref = torch.tensor([[math.log(0.25), math.log(0.2)]], dtype=DT)
    ln2 = math.log(2.0)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[ln2, 0.0]], dtype=DT))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"),
                               torch.tensor([[0.5 * ln2 ** 2, 0.0]], dtype=DT))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"),
                               torch.tensor([[0.5 + ln2 - 1.0, 0.0]], dtype=DT))
    torch.testing.assert_close(kl_penalty(logp, ref), kl_penalty(logp, ref, "k3"))  # default
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k4")


def test_k3_stays_finite_for_extreme_log_ratios():
    """A valid token with logp - ref = -100 (the policy all but rules out what the reference
    sampled): exp(100) is inf in fp32; the clamps keep loss and gradient finite, and a token
    beyond them (either side) adds the bound, no gradient."""
    logp = torch.tensor([[-101.0, math.log(0.5), -0.1]], dtype=torch.float32, requires_grad=True)
    ref = torch.tensor([[-1.0, math.log(0.25), -120.0]], dtype=torch.float32)
    kl = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(kl.detach(), torch.tensor([[10.0, 0.5 + math.log(2) - 1, 10.0]]), rtol=1e-6, atol=1e-6)
    loss, metrics = kl_loss(logp, ref, torch.ones(1, 3), estimator="k3", loss_agg_mode="token-mean")
    assert math.isfinite(metrics["actor/kl_loss"])
    grad = grad_of(loss, logp)
    assert torch.isfinite(grad).all()
    assert grad[0, 0] == 0 and grad[0, 2] == 0 and grad[0, 1] != 0  # clamped tokens: no gradient


@pytest.mark.parametrize("log_ratio", [-19.0, -5.0, -2.7, 11.5, 19.0])
def test_k3_gradient_is_bounded_where_the_log_ratio_is_extreme(log_ratio):
    """The log-ratio clamp alone left d k3 / d logp = 1 - exp(19) ~ -1.8e8 at a log-ratio of -19
    (a finite loss, so no non-finite check fires). Beyond the value clamp (k3 > 10: log-ratio
    below ~-2.61 or above ~11) the token adds 10 and no gradient."""
    logp = torch.tensor([log_ratio - 1.0], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-1.0]), "k3")
    assert float(kl) == 10.0
    assert float(grad_of(kl.sum(), logp)) == 0.0


@pytest.mark.parametrize("log_ratio", [-2.6, -1.0, -0.01, 0.0, 0.3, 4.0, 10.9])
def test_k3_is_exact_with_a_bounded_gradient_inside_the_clamp(log_ratio):
    logp = torch.tensor([log_ratio - 1.0], dtype=DT, requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-1.0], dtype=DT), "k3")
    assert float(kl) == pytest.approx(math.exp(-log_ratio) + log_ratio - 1, rel=1e-12, abs=1e-15)
    grad = float(grad_of(kl.sum(), logp))
    assert grad == pytest.approx(1 - math.exp(-log_ratio), rel=1e-12, abs=1e-15)
    assert abs(grad) < 13


def test_kl_loss_aggregates_valid_tokens_only():
    logp = torch.tensor([[math.log(0.5), 50.0]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), -50.0]], dtype=DT)
    mask = torch.tensor([[1.0, 0.0]], dtype=DT)
    loss, metrics = kl_loss(logp, ref, mask, estimator="k3", loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(0.5 + math.log(2) - 1)
    assert metrics["actor/kl_loss"] == pytest.approx(loss.item())
    assert grad_of(loss, logp)[0, 1] == 0


def test_entropy_and_masked_mean():
    logits = torch.zeros(2, 3, 5, dtype=DT)
    logits[1, 0] = torch.tensor([100.0, 0, 0, 0, 0])
    ent = entropy_from_logits(logits)
    assert ent.shape == (2, 3)
    assert float(ent[0, 0]) == pytest.approx(math.log(5))
    assert float(ent[1, 0]) == pytest.approx(0.0, abs=1e-12)
    x = torch.tensor([[1.0, 2.0, float("nan")]], dtype=DT)
    assert float(masked_mean(x, torch.tensor([[1, 1, 0]]))) == pytest.approx(1.5)
    assert float(masked_mean(x, torch.tensor([[True, False, False]]))) == pytest.approx(1.0)


def test_unknown_names_raise_listing_valid_values():
    logp, old, adv, mask = random_batch([2], seed=12)
    with pytest.raises(ValueError, match=r"gspo-token"):
        policy_loss(logp, old, adv, mask, importance_sampling="sequence")
    with pytest.raises(ValueError, match=r"seq-mean-token-sum-norm"):
        policy_loss(logp, old, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"token-mean"):
        aggregate_loss(adv, mask, "sum")


def test_names_match_config_schema():
    from roll_gspo.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, REWARD_NORMS
    from roll_gspo.schema import config as schema

    assert list(POLICY_LOSSES) == schema.IMPORTANCE_SAMPLING_CHOICES
    assert LOSS_AGG_MODES == schema.LOSS_AGG_MODES
    from roll_gspo.catalog.estimators import names

    # The torch registry holds the estimators an rlvr run computes without a critic (GAE has its own path).
    assert list(ADV_ESTIMATORS) == [e for e in names("rlvr") if e not in names(needs_critic=True)]
    assert schema.ADV_ESTIMATORS == names()
    assert REWARD_NORMS == schema.REWARD_NORMS
    assert KL_ESTIMATORS == schema.KL_ESTIMATORS


def test_library_imports_with_torch_alone():
    heavy = ["ray", "vllm", "deepspeed", "transformers"]
    code = ("import sys, roll_gspo.algorithms; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
