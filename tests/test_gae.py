"""GAE and the clipped value loss (roll_gspo.algorithms.gae) against independent scalar references,
values and gradients. The critic role that will call them is not built (adv_estimator: gae is refused)."""
import pytest
import torch

from roll_gspo.algorithms.gae import gae_advantages, value_loss

DT = torch.float64


def reference_gae(rewards, values, mask, gamma, lambd):
    """Per row: the valid positions in order, then the textbook backward recursion over them."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = float(values[i, steps[k + 1]]) if k + 1 < len(steps) else 0.0
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lambd * running
            advantages[i, t] = running
    return advantages, torch.where(mask > 0, advantages + values, torch.zeros_like(values))


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=DT)
    rewards = torch.randn(4, 6, generator=g, dtype=DT)
    values = torch.randn(4, 6, generator=g, dtype=DT)
    nan = torch.full_like(values, float("nan"))
    return torch.where(mask > 0, rewards, nan), torch.where(mask > 0, values, nan), mask


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0)])
def test_gae_matches_the_scalar_recursion(gamma, lambd):
    rewards, values, mask = data()
    advantages, returns = gae_advantages(rewards, values, mask, gamma=gamma, lambd=lambd)
    expected_adv, expected_ret = reference_gae(torch.nan_to_num(rewards), torch.nan_to_num(values), mask, gamma, lambd)
    torch.testing.assert_close(advantages, expected_adv)
    torch.testing.assert_close(returns, expected_ret)
    assert torch.isfinite(advantages).all() and (advantages[mask == 0] == 0).all()


def test_gamma_and_lambda_one_give_reward_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=DT)
    values = torch.tensor([[0.2, 0.4, 0.6, 9.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=DT)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lambd=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=DT))
    torch.testing.assert_close(advantages, torch.tensor([[0.8, 0.6, 0.4, 0.0]], dtype=DT))


def test_gae_refuses_out_of_range_coefficients():
    rewards, values, mask = data()
    with pytest.raises(ValueError, match="gamma and lambd"):
        gae_advantages(rewards, values, mask, gamma=1.1)


def reference_value_loss(values, old, returns, mask, clip):
    total, count = values.new_zeros(()), 0
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[i, t] == 0:
                continue
            v, o, r = values[i, t], float(old[i, t]), float(returns[i, t])
            err = (v - r) ** 2
            if clip is not None:
                vc = o + torch.clamp(v - o, -clip, clip)
                err_c = (vc - r) ** 2
                err = err_c if err_c > err else err
            total = total + 0.5 * err
            count += 1
    return total / count


@pytest.mark.parametrize("clip", [None, 0.5, 0.05])
def test_value_loss_and_gradient_match_the_scalar_reference(clip):
    g = torch.Generator().manual_seed(3)
    _, _, mask = data()
    old = torch.randn(4, 6, generator=g, dtype=DT)
    values = (old + 0.3 * torch.randn(4, 6, generator=g, dtype=DT)).requires_grad_()
    returns = torch.randn(4, 6, generator=g, dtype=DT)
    loss, metrics = value_loss(values, old, returns, mask, value_clip=clip)
    expected = reference_value_loss(values, old, returns, mask, clip)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, values)
    (expected_grad,) = torch.autograd.grad(expected, values)
    torch.testing.assert_close(grad, expected_grad)
    if clip is None:
        assert metrics["critic/vf_clipfrac"] == 0
    elif clip == 0.05:  # far inside the 0.3 spread of values around old: the clipped branch fires
        assert metrics["critic/vf_clipfrac"] > 0


def test_value_loss_refuses_a_non_positive_clip():
    _, _, mask = data()
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(4, 6), mask, value_clip=0.0)
