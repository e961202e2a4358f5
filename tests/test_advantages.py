"""Tests of roll_gspo.algorithms.advantages: reward normalisation, estimators, the full chain."""
import io
import json
import math

import pytest
import torch

from roll_gspo.algorithms import (
    ADV_ESTIMATORS,
    RunningMeanStd,
    clip_rewards,
    compute_advantages,
    get_adv_estimator,
    normalize_rewards,
    register_adv_estimator,
    token_level_rewards,
    whiten,
)

DT = torch.float64
EPS = 1e-6


def t(values):
    return torch.tensor(values, dtype=DT)


# --------------------------------------------------------------------------------------------
# Reward normalisation
# --------------------------------------------------------------------------------------------
REWARDS = [0.0, 2.0, 1.0, 5.0]  # groups of 2: {0, 2} mean 1 std 1; {1, 5} mean 3 std 2


def test_normalize_none_returns_rewards_unchanged():
    normed, _ = normalize_rewards(t(REWARDS), 2, None)
    torch.testing.assert_close(normed, t(REWARDS))


def test_normalize_group_modes():
    full, _ = normalize_rewards(t(REWARDS), 2, "group", eps=EPS)
    expected = t([-1 / (1 + EPS), 1 / (1 + EPS), -2 / (2 + EPS), 2 / (2 + EPS)])
    torch.testing.assert_close(full, expected)
    shifted, _ = normalize_rewards(t(REWARDS), 2, "group", shift=True)
    torch.testing.assert_close(shifted, t([-1.0, 1.0, -2.0, 2.0]))
    scaled, _ = normalize_rewards(t(REWARDS), 2, "group", scale=True, eps=EPS)
    torch.testing.assert_close(scaled, t([0.0, 2 / (1 + EPS), 1 / (2 + EPS), 5 / (2 + EPS)]))


def test_normalize_batch_modes():
    std = math.sqrt((4 + 0 + 1 + 9) / 4)  # population std of REWARDS (mean 2)
    full, metrics = normalize_rewards(t(REWARDS), 2, "batch", eps=EPS)
    torch.testing.assert_close(full, t([(r - 2.0) / (std + EPS) for r in REWARDS]))
    assert metrics["critic/reward_norm_std"] == pytest.approx(std)
    shifted, _ = normalize_rewards(t(REWARDS), 2, "batch", shift=True)
    torch.testing.assert_close(shifted, t([-2.0, 0.0, -1.0, 3.0]))
    scaled, _ = normalize_rewards(t(REWARDS), 2, "batch", scale=True, eps=EPS)
    torch.testing.assert_close(scaled, t([r / (std + EPS) for r in REWARDS]))


def test_normalize_running_updates_first_then_normalises():
    running = RunningMeanStd()
    first, _ = normalize_rewards(t([1.0, 2.0, 3.0]), 1, "running", running=running, eps=EPS)
    std1 = math.sqrt(2 / 3)
    torch.testing.assert_close(first, t([-1 / (std1 + EPS), 0.0, 1 / (std1 + EPS)]))
    second, metrics = normalize_rewards(t([4.0, 5.0]), 1, "running", running=running, eps=EPS)
    std2 = math.sqrt(2.0)  # over 1..5, mean 3
    torch.testing.assert_close(second, t([1 / (std2 + EPS), 2 / (std2 + EPS)]))
    assert metrics["critic/reward_running_count"] == 5
    shifted, _ = normalize_rewards(t([3.0]), 1, "running", shift=True, running=running)
    torch.testing.assert_close(shifted, t([0.0]))  # mean of 1..5 and 3 is 3


def test_normalize_rejects_contradictions_and_bad_input():
    with pytest.raises(ValueError, match="shift"):
        normalize_rewards(t(REWARDS), 2, "batch", shift=True, scale=True)
    with pytest.raises(ValueError, match="RunningMeanStd"):
        normalize_rewards(t(REWARDS), 2, "running")
    with pytest.raises(ValueError, match="groups of 3"):
        normalize_rewards(t(REWARDS), 3, "group")
    with pytest.raises(ValueError, match="'group'"):
        normalize_rewards(t(REWARDS), 2, "prompt")


def test_clip_rewards():
    clipped, metrics = clip_rewards(t([-3.0, 0.5, 2.0, -1.0]), 1.0)
    torch.testing.assert_close(clipped, t([-1.0, 0.5, 1.0, -1.0]))
    assert metrics["critic/reward_clipfrac"] == pytest.approx(0.5)
    unchanged, _ = clip_rewards(t([-3.0]), None)
    torch.testing.assert_close(unchanged, t([-3.0]))
    with pytest.raises(ValueError):
        clip_rewards(t([1.0]), 0.0)


# --------------------------------------------------------------------------------------------
# RunningMeanStd
# --------------------------------------------------------------------------------------------
def test_running_mean_std_matches_concatenated_batches():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g, dtype=DT) * s + o
               for n, s, o in [(5, 1.0, 0.0), (1, 1.0, 10.0), (17, 3.0, -2.0), (3, 0.1, 4.0)]]
    running = RunningMeanStd()
    running.update(torch.empty(0))  # no-op
    for b in batches:
        running.update(b)
    everything = torch.cat(batches)
    assert running.count == everything.numel()
    assert running.mean == pytest.approx(float(everything.mean()), rel=1e-12)
    assert running.std == pytest.approx(float(everything.std(unbiased=False)), rel=1e-12)


def test_running_state_round_trip_gives_identical_normalisation():
    running = RunningMeanStd()
    for b in ([1.0, 4.0, 2.0], [0.5, 7.0]):
        running.update(t(b))

    buffer = io.BytesIO()
    torch.save(running.state_dict(), buffer)
    buffer.seek(0)
    from_torch, from_json = RunningMeanStd(), RunningMeanStd()
    from_torch.load_state_dict(torch.load(buffer))
    from_json.load_state_dict(json.loads(json.dumps(running.state_dict())))

    new_batch = t([3.0, -1.0, 2.5, 9.0])
    expected, _ = normalize_rewards(new_batch, 2, "running", running=running)
    for restored in (from_torch, from_json):
        got, _ = normalize_rewards(new_batch, 2, "running", running=restored)
        assert torch.equal(got, expected)
        assert restored.state_dict() == running.state_dict()
    # A fresh tracker (state lost) would normalise differently.
    fresh, _ = normalize_rewards(new_batch, 2, "running", running=RunningMeanStd())
    assert not torch.allclose(fresh, expected)
    with pytest.raises(ValueError, match="var"):
        RunningMeanStd().load_state_dict({"count": 1.0, "mean": 0.0})


# --------------------------------------------------------------------------------------------
# Token-level rewards and estimators
# --------------------------------------------------------------------------------------------
def test_token_level_rewards_on_last_valid_token():
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    rewards = token_level_rewards(t([1.0, 2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(rewards, t([[0, 1, 0, 0], [0, 0, 0, 2], [0, 0, 0, 0], [0, 0, 4, 0]]))


def test_token_level_rewards_with_kl_penalty():
    mask = t([[1, 1, 1, 0]])
    kl = t([[0.1, 0.2, 0.3, 99.0]])  # the padded 99 must not leak in
    rewards = token_level_rewards(t([1.0]), mask, kl=kl, kl_coef=0.5)
    torch.testing.assert_close(rewards, t([[-0.05, -0.1, 1.0 - 0.15, 0.0]]))


def test_reinforce_is_reward_to_go():
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    token_rewards = t([[0.1, -0.2, 1.0, 9.0], [0.0, 2.0, 0.0, 0.0]])
    adv = ADV_ESTIMATORS["reinforce"](token_rewards, mask, 1)
    torch.testing.assert_close(adv, t([[0.9, 0.8, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]))


def test_grpo_group_zscore_with_population_std():
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [0, 1], [1, 1]])
    # Final rewards 0, 0, 1 | 2, 2, 2 (the second group has std 0 -> advantages 0).
    token_rewards = t([[0, 0], [0, 0], [0, 1], [0, 2], [0, 2], [0, 2]])
    adv = ADV_ESTIMATORS["grpo"](token_rewards, mask, 3, eps=EPS)
    std = math.sqrt(2) / 3  # population std of {0, 0, 1}; the unbiased one would be 0.577
    low, high = (-1 / 3) / (std + EPS), (2 / 3) / (std + EPS)
    expected = t([[low, low], [low, 0], [high, high], [0, 0], [0, 0], [0, 0]])
    torch.testing.assert_close(adv, expected)
    assert high == pytest.approx(math.sqrt(2), rel=1e-5)


def test_rloo_leave_one_out_baseline():
    mask = torch.ones(4, 2, dtype=DT)
    token_rewards = t([[0, 1], [0, 2], [0, 3], [0, 6]])
    adv = ADV_ESTIMATORS["rloo"](token_rewards, mask, 4)
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]
    torch.testing.assert_close(adv, t([[a, a] for a in expected]))
    pairs = ADV_ESTIMATORS["rloo"](token_rewards, mask, 2)
    torch.testing.assert_close(pairs[:, 0], t([-1.0, 1.0, -3.0, 3.0]))
    with pytest.raises(ValueError, match="group_size"):
        ADV_ESTIMATORS["rloo"](token_rewards, mask, 1)


def test_estimator_registry():
    assert list(ADV_ESTIMATORS) == ["reinforce", "grpo", "rloo", "gdpo"]
    with pytest.raises(ValueError, match="reinforce"):
        get_adv_estimator("gae")

    @register_adv_estimator("test-constant")
    def constant(token_rewards, response_mask, group_size, eps=1e-6):
        return response_mask.to(token_rewards.dtype) * 7.0

    try:
        adv, _ = compute_advantages(t([1.0, 0.0]), torch.ones(2, 3, dtype=DT), group_size=2,
                                    adv_estimator="test-constant")
        assert torch.all(adv == 7.0)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("test-constant")(lambda *a, **k: None)
    finally:
        del ADV_ESTIMATORS["test-constant"]


def test_whiten_masked_zscore():
    values = t([[1.0, 2.0, 99.0], [3.0, 6.0, float("nan")]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    out = whiten(values, mask)
    valid = t([1.0, 2.0, 3.0, 6.0])
    expected = (valid - 3.0) / valid.std(unbiased=False)
    torch.testing.assert_close(out[mask.bool()], expected)
    assert torch.all(out[~mask.bool()] == 0)


# --------------------------------------------------------------------------------------------
# compute_advantages: the chain
# --------------------------------------------------------------------------------------------
def test_reward_clip_comes_after_normalisation():
    mask = torch.ones(4, 2, dtype=DT)
    adv, metrics = compute_advantages(t([0.0, 0.0, 0.0, 10.0]), mask, group_size=4,
                                      adv_estimator="reinforce", reward_norm="batch",
                                      reward_clip=1.0, eps=EPS)
    z = -2.5 / (math.sqrt(75 / 4) + EPS)  # batch z-score of the zeros
    torch.testing.assert_close(adv[:, 0], t([z, z, z, 1.0]))  # clip before norm: 1.73 for the last
    assert metrics["critic/rewards_normed_mean"] == pytest.approx((3 * z + 1) / 4)
    assert metrics["critic/reward_clipfrac"] == pytest.approx(0.25)


def test_compute_advantages_grpo_default_chain_and_metrics():
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    adv, metrics = compute_advantages(t([1.0, 0.0, 0.0, 0.0]), mask, group_size=2,
                                      adv_estimator="grpo", eps=EPS)
    one = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(adv, t([[one, one, 0], [-one, -one, -one], [0, 0, 0], [0, 0, 0]]))
    for key in ("critic/advantages_mean", "critic/advantages_max", "critic/advantages_min",
                "critic/rewards_normed_mean", "critic/score_mean"):
        assert isinstance(metrics[key], float)
    assert metrics["critic/advantages_max"] == pytest.approx(one)
    assert metrics["critic/advantages_min"] == pytest.approx(-one)
    assert metrics["critic/advantages_mean"] == pytest.approx((2 * one - 3 * one) / 9)


def test_compute_advantages_token_level_kl():
    mask = t([[1, 1, 1], [1, 1, 0]])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.2, 50.0]])
    adv, metrics = compute_advantages(t([1.0, 2.0]), mask, group_size=1, adv_estimator="reinforce",
                                      kl=kl, kl_coef=0.5)
    # token rewards: [-0.05, -0.1, 0.85] and [-0.2, 1.9]; reward-to-go along each response.
    torch.testing.assert_close(adv, t([[0.7, 0.75, 0.85], [1.7, 1.9, 0.0]]))
    assert metrics["critic/kl_penalty_mean"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4 + 0.2) / 5)
    # grpo scores the KL-penalised sum: 1 - 0.3 = 0.7 vs 2 - 0.3 = 1.7 -> -1 / +1.
    adv_grpo, _ = compute_advantages(t([1.0, 2.0]), mask, group_size=2, adv_estimator="grpo",
                                     kl=kl, kl_coef=0.5, eps=EPS)
    torch.testing.assert_close(adv_grpo[:, 0], t([-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)]))


def test_compute_advantages_whiten_then_advantage_clip():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(8, generator=g, dtype=DT) * 4
    mask = (torch.arange(5)[None, :] < torch.randint(1, 6, (8, 1), generator=g)).to(DT)
    whitened, _ = compute_advantages(scores, mask, group_size=4, adv_estimator="reinforce",
                                     whiten_advantages=True)
    valid = whitened[mask.bool()]
    assert float(valid.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(valid.std(unbiased=False)) == pytest.approx(1.0, rel=1e-6)

    clipped, metrics = compute_advantages(scores, mask, group_size=4, adv_estimator="reinforce",
                                          whiten_advantages=True, advantage_clip=0.5)
    torch.testing.assert_close(clipped, whitened.clamp(-0.5, 0.5))  # clip after whitening
    assert metrics["critic/advantages_max"] == pytest.approx(0.5)
    assert metrics["critic/advantages_min"] == pytest.approx(-0.5)
    expected_frac = float((valid.abs() > 0.5).to(DT).mean())
    assert 0 < expected_frac < 1
    assert metrics["critic/advantage_clipfrac"] == pytest.approx(expected_frac)
    assert torch.all(clipped[~mask.bool()] == 0)


def test_compute_advantages_running_norm_needs_and_updates_state():
    mask = torch.ones(2, 1, dtype=DT)
    with pytest.raises(ValueError, match="RunningMeanStd"):
        compute_advantages(t([1.0, 2.0]), mask, group_size=2, adv_estimator="reinforce",
                           reward_norm="running")
    running = RunningMeanStd()
    adv, _ = compute_advantages(t([1.0, 3.0]), mask, group_size=2, adv_estimator="reinforce",
                                reward_norm="running", running_stats=running, eps=EPS)
    torch.testing.assert_close(adv[:, 0], t([-1 / (1 + EPS), 1 / (1 + EPS)]))
    assert running.count == 2 and running.mean == pytest.approx(2.0)


# --------------------------------------------------------------------------------------------
# Zero-variance sets: never divided by their std
# --------------------------------------------------------------------------------------------
F32 = torch.float32
MIXED = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # an all-correct group, then a mixed one


def test_reward_scale_leaves_a_constant_group_unscaled_and_counts_it():
    scaled, metrics = normalize_rewards(t(MIXED), 4, "group", scale=True, eps=EPS)
    torch.testing.assert_close(scaled, t([1.0] * 4 + [0.0, 1 / (0.5 + EPS), 0.0, 1 / (0.5 + EPS)]))
    assert metrics["reward/zero_std_groups"] == 1
    assert metrics["critic/reward_norm_degenerate_sets"] == 1
    full, _ = normalize_rewards(t(MIXED), 4, "group", eps=EPS)
    torch.testing.assert_close(full, t([0.0] * 4 + [-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)] * 2))
    # With reward_clip 10 the constant group used to become [10] * 4 (1 / eps clipped).
    adv, adv_metrics = compute_advantages(t(MIXED), torch.ones(8, 3, dtype=DT), group_size=4,
                                          adv_estimator="reinforce", reward_norm="group",
                                          reward_scale=True, reward_clip=10.0, eps=EPS)
    assert float(adv.max()) < 2.01 and adv_metrics["reward/zero_std_groups"] == 1


@pytest.mark.parametrize("mode", ["group", "batch", "running"])
def test_constant_rewards_in_float32_are_not_blown_up(mode):
    """0.7 repeated has a float32 mean that is not 0.7: its rounding noise over eps was ~0.06
    (z-score) and 0.7 / eps (scale). Group, batch and the first running window act alike."""
    rewards = torch.full((8,), 0.7, dtype=F32)
    full, metrics = normalize_rewards(rewards, 8, mode, running=RunningMeanStd())
    assert torch.equal(full, torch.zeros(8, dtype=F32))
    assert metrics["critic/reward_norm_degenerate_sets"] == 1 and metrics["reward/zero_std_groups"] == 1
    scaled, _ = normalize_rewards(rewards, 8, mode, scale=True, running=RunningMeanStd())
    assert torch.equal(scaled, rewards)
    shifted, _ = normalize_rewards(rewards, 8, mode, shift=True, running=RunningMeanStd())
    assert torch.equal(shifted, torch.zeros(8, dtype=F32))


def test_running_window_scales_once_it_has_spread():
    running = RunningMeanStd()
    first, _ = normalize_rewards(t([1.0, 1.0]), 2, "running", scale=True, running=running, eps=EPS)
    torch.testing.assert_close(first, t([1.0, 1.0]))  # first window constant: left unscaled
    second, metrics = normalize_rewards(t([0.0, 0.0]), 2, "running", scale=True, running=running,
                                        eps=EPS)
    torch.testing.assert_close(second, t([0.0, 0.0]))  # std of {1,1,0,0} is 0.5: scaled
    assert metrics["critic/reward_norm_degenerate_sets"] == 0 and metrics["reward/zero_std_groups"] == 1
    third, _ = normalize_rewards(t([1.0, 1.0]), 2, "running", scale=True, running=running, eps=EPS)
    std = math.sqrt(running.var)
    torch.testing.assert_close(third, t([1 / (std + EPS)] * 2))


def test_grpo_constant_group_gets_exactly_zero_advantage():
    scores = torch.tensor([0.7] * 8 + [0.0, 1.0] * 4, dtype=F32)
    adv, _ = compute_advantages(scores, torch.ones(16, 2, dtype=F32), group_size=8, adv_estimator="grpo")
    assert torch.equal(adv[:8], torch.zeros(8, 2, dtype=F32))
    torch.testing.assert_close(adv[8:, 0], torch.tensor([-1.0, 1.0] * 4, dtype=F32), atol=1e-5, rtol=0)


def test_whiten_equal_advantages_gives_zero():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F32)
    values = torch.full((2, 3), 0.7, dtype=F32)
    assert torch.equal(whiten(values, mask), torch.zeros(2, 3, dtype=F32))
    adv, _ = compute_advantages(torch.full((4,), 0.7, dtype=F32), torch.ones(4, 5, dtype=F32), group_size=2,
                                adv_estimator="reinforce", whiten_advantages=True)
    assert torch.equal(adv, torch.zeros(4, 5, dtype=F32))
    # Near-constant values are damped smoothly by eps inside the root, not blown up.
    tiny = torch.tensor([[0.7, 0.7 + 1e-6]], dtype=torch.float64)
    assert float(whiten(tiny, torch.ones(1, 2)).abs().max()) < 1e-2
