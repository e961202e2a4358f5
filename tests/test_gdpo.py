"""GDPO (`adv_estimator: gdpo`): parity with verl's formula, the reward components it reads, and the
config refusals that keep it from running on a reward that has no components."""
from collections import defaultdict

import numpy as np
import pytest
import torch

from roll_gspo.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    gdpo_advantages,
    reward_component_matrix,
)
from roll_gspo.config.errors import ConfigError
from roll_gspo.schema.config import PipelineConfig, RewardConfig, TaskConfig
from roll_gspo.config.checks.validate import validate_config

EPS = 1e-6


# --------------------------------------------------------------------------------------------
# An independent reference: verl's compute_gdpo_outcome_advantage re-typed (its loops over `index`,
# torch.std's sample std, a group of one getting mean 0 and std 1, then masked_whiten with the
# Bessel-corrected variance), with each component's score placed on the last valid token.
# --------------------------------------------------------------------------------------------
def _ref_masked_mean(values, mask):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def _ref_masked_whiten(values, mask):
    mean = _ref_masked_mean(values, mask)
    var = _ref_masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    var = var * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _ref_grpo(token_level_rewards, response_mask, index, epsilon):
    scores = token_level_rewards.sum(dim=-1)
    by_id = defaultdict(list)
    for i in range(scores.shape[0]):
        by_id[index[i]].append(scores[i])
    means, stds = {}, {}
    for idx, group in by_id.items():
        if len(group) == 1:
            means[idx], stds[idx] = torch.tensor(0.0, dtype=scores.dtype), torch.tensor(1.0, dtype=scores.dtype)
        else:
            stacked = torch.stack(group)
            means[idx], stds[idx] = torch.mean(stacked), torch.std(stacked)
    out = scores.clone()
    for i in range(scores.shape[0]):
        out[i] = (scores[i] - means[index[i]]) / (stds[index[i]] + epsilon)
    return out.unsqueeze(-1) * response_mask


def verl_gdpo_reference(components, response_mask, index, weights=None, epsilon=1e-6):
    """components (B, K) -> (B, T), as verl computes it."""
    last = response_mask.sum(dim=1).long() - 1
    total = None
    weights = torch.ones(components.shape[1], dtype=components.dtype) if weights is None else torch.tensor(
        weights, dtype=components.dtype)
    for k in range(components.shape[1]):
        placed = torch.zeros_like(response_mask, dtype=components.dtype)
        placed[torch.arange(placed.size(0)), last] = components[:, k]
        part = weights[k] * _ref_grpo(placed, response_mask, index, epsilon)
        total = part if total is None else total + part
    return _ref_masked_whiten(total, response_mask) * response_mask


def _random_batch(seed, groups, group_size, parts, width=9, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    batch = groups * group_size
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width).expand(batch, width) < lengths[:, None]).to(dtype)
    # Discrete parts (0/1 correctness, a graded one) and a continuous one, as reward workers send.
    comps = torch.stack([torch.randint(0, 2, (batch,), generator=gen).to(dtype),
                         torch.randint(0, 5, (batch,), generator=gen).to(dtype) / 4,
                         torch.rand(batch, generator=gen, dtype=dtype) * 3 - 1][:parts], dim=-1)
    comps[:group_size] = comps[0]  # group 0: every component equal across the group (zero variance)
    comps[group_size:2 * group_size, 0] = 1.0  # group 1: its first component equal across the group
    return comps, mask


@pytest.mark.parametrize("seed,groups,group_size,parts,weights", [
    (0, 4, 4, 2, None), (1, 5, 3, 3, None), (2, 3, 8, 2, [0.7, 0.3]), (3, 6, 2, 3, [1.0, 2.0, 0.5]),
    (4, 4, 5, 1, None),
])
def test_gdpo_equals_verl_reference(seed, groups, group_size, parts, weights):
    comps, mask = _random_batch(seed, groups, group_size, parts)
    index = np.repeat(np.arange(groups), group_size)
    expected = verl_gdpo_reference(comps, mask, index, weights, EPS)
    token_rewards = torch.zeros_like(mask)
    got = gdpo_advantages(token_rewards, mask, group_size, eps=EPS, components=comps, weights=weights)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert torch.all(got[~mask.bool()] == 0)
    # Whitened: mean 0 over valid tokens; the zero-variance group has its components' share 0 before that.
    assert abs(float(got[mask.bool()].mean())) < 1e-9


def test_gdpo_equals_verl_reference_in_float32():
    comps, mask = _random_batch(7, 4, 4, 2, dtype=torch.float32)
    index = np.repeat(np.arange(4), 4)
    expected = verl_gdpo_reference(comps, mask, index, None, EPS)
    got = gdpo_advantages(torch.zeros_like(mask), mask, 4, eps=EPS, components=comps)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_gdpo_through_compute_advantages_ignores_the_combined_score():
    comps, mask = _random_batch(11, 3, 4, 2)
    index = np.repeat(np.arange(3), 4)
    expected = verl_gdpo_reference(comps, mask, index, [2.0, 1.0], EPS)
    scores = torch.randn(12, dtype=torch.float64) * 100  # not read by gdpo
    adv, metrics = compute_advantages(scores, mask, group_size=4, adv_estimator="gdpo",
                                      reward_components=comps, component_weights=[2.0, 1.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert metrics["critic/advantages_max"] > 0 > metrics["critic/advantages_min"]


def test_gdpo_keeps_a_weak_reward_from_being_drowned():
    # One group: correctness in {0, 10}, format in {0, 1}. Summed and z-scored (GRPO), the format's
    # gap is a tenth of the correctness gap; normalised apart (GDPO), the two gaps are equal.
    comps = torch.tensor([[10.0, 0.0], [10.0, 1.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.float64)
    grpo = ADV_ESTIMATORS["grpo"](torch.zeros_like(mask).index_put_((torch.arange(4), torch.full((4,), 2)),
                                                                    comps.sum(-1)), mask, 4)[:, 0]
    assert torch.isclose(grpo[1] - grpo[0], (grpo[0] - grpo[2]) / 10)
    adv = gdpo_advantages(torch.zeros_like(mask), mask, 4, components=comps)[:, 0]
    assert adv[1] - adv[0] > 0
    assert torch.isclose(adv[1] - adv[0], adv[0] - adv[2])
    weighted = gdpo_advantages(torch.zeros_like(mask), mask, 4, components=comps, weights=[1.0, 0.5])[:, 0]
    assert torch.isclose(weighted[1] - weighted[0], (weighted[0] - weighted[2]) / 2)


def test_gdpo_all_groups_degenerate_gives_zero():
    comps = torch.tensor([[1.0, 0.5]] * 4 + [[0.0, 1.0]] * 4, dtype=torch.float64)
    mask = torch.ones(8, 5, dtype=torch.float64)
    assert torch.all(gdpo_advantages(torch.zeros_like(mask), mask, 4, components=comps) == 0)


def test_gdpo_refuses_missing_or_misshapen_components():
    mask = torch.ones(4, 2)
    with pytest.raises(ValueError, match="reward components"):
        gdpo_advantages(torch.zeros(4, 2), mask, 2)
    with pytest.raises(ValueError, match="components must be"):
        gdpo_advantages(torch.zeros(4, 2), mask, 2, components=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="2 weights for 3"):
        gdpo_advantages(torch.zeros(4, 2), mask, 2, components=torch.zeros(4, 3), weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="group_size >= 2"):
        gdpo_advantages(torch.zeros(4, 2), mask, 1, components=torch.zeros(4, 1))
    assert ADV_ESTIMATORS["gdpo"] is gdpo_advantages


def test_reward_component_matrix_reads_the_named_numbers():
    rows = [{"accuracy": 1.0, "format_rate": 0.0, "truncated": 0.0}, None, {"accuracy": 0.0, "format_rate": 1.0}]
    out = reward_component_matrix(rows, ["accuracy", "format_rate"], statuses=["ok", "format", "ok"],
                                  domains=["a", "a", "a"])
    assert out.tolist() == [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]  # scored without its scorer: all 0
    with pytest.raises(ValueError, match=r"domain 'math'.*\['format_rate'\]"):
        reward_component_matrix([{"accuracy": 1.0}], ["accuracy", "format_rate"], statuses=["ok"], domains=["math"])
    with pytest.raises(ValueError, match="sent none"):
        reward_component_matrix([None], ["accuracy"], statuses=["ok"], domains=["math"])


def test_the_task_worker_sends_the_components_the_check_expects():
    """The check's table of what TaskRewardWorker and IFEval send is what their scorers report."""
    import json

    from roll_gspo.config.checks.rewards import REWARD_COMPONENTS
    from roll_gspo.rewards.ifeval import InstructionResult, instruction_metrics
    from roll_gspo.tasks import score_reply

    truth = json.dumps({"task": "t", "source": "builtin", "name": "arith", "format_weight": 0.5,
                        "partial_credit": False, "answer": "46"})
    scored = score_reply("12+34=", "<answer>46</answer>", truth)
    assert scored == 1.5 and scored.metrics["accuracy"] == 1.0 and scored.metrics["format_rate"] == 1.0
    assert set(scored.metrics) | {"truncated"} == set(REWARD_COMPONENTS["TaskRewardWorker"])
    ifeval = instruction_metrics([InstructionResult("x", True, True)])
    assert set(ifeval) == set(REWARD_COMPONENTS["IFEvalRewardWorker"])


# --------------------------------------------------------------------------------------------
# Config: refused before any worker starts
# --------------------------------------------------------------------------------------------
def _cfg(worker="roll_gspo.workers.rewards.MathRuleRewardWorker", **overrides):
    cfg = PipelineConfig(adv_estimator="gdpo", num_return_sequences_in_group=4)
    cfg.rewards = {"math": RewardConfig(worker_cls=worker)}
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _errors(cfg):
    from roll_gspo.config.checks.rewards import _gdpo_components

    return [(f.key, f.message) for f in _gdpo_components(cfg) if f.level == "error"]


def test_gdpo_with_a_component_less_reward_is_refused_naming_the_keys():
    found = _errors(_cfg())
    assert len(found) == 1
    key, message = found[0]
    assert key == "rewards.math.worker_cls"
    assert "MathRuleRewardWorker" in message and "['accuracy', 'format_rate']" in message and "grpo" in message


@pytest.mark.parametrize("worker", ["LLMJudgeRewardWorker", "RewardModelWorker", "CodeSandboxRewardWorker",
                                    "RegexMatchRewardWorker", "MultipleChoiceRewardWorker"])
def test_every_single_reward_worker_is_refused(worker):
    assert [k for k, _ in _errors(_cfg(f"roll_gspo.workers.rewards.{worker}"))] == ["rewards.math.worker_cls"]


def test_gdpo_refused_by_the_whole_validation():
    cfg = _cfg()
    with pytest.raises(ConfigError, match=r"rewards\.math\.worker_cls.*gdpo"):
        validate_config(cfg)


def test_gdpo_with_the_task_worker_passes_and_its_keys_are_checked():
    task_worker = "roll_gspo.workers.rewards.TaskRewardWorker"
    cfg = _cfg(task_worker)
    cfg.tasks = {"arith": TaskConfig(format_weight=0.2, reward="math")}
    assert _errors(cfg) == []
    cfg.gdpo_reward_keys = ["accuracy", "length"]
    assert [k for k, m in _errors(cfg) if "['length']" in m] == ["gdpo_reward_keys"]
    cfg.gdpo_reward_keys = ["accuracy", "format_rate"]
    cfg.gdpo_reward_weights = [1.0]
    assert [k for k, _ in _errors(cfg)] == ["gdpo_reward_weights"]
    cfg.gdpo_reward_weights = None
    cfg.tasks["arith"].format_weight = 0.0
    assert [k for k, _ in _errors(cfg)] == ["tasks.arith.format_weight"]
    cfg.gdpo_reward_keys = ["accuracy"]
    assert _errors(cfg) == []


def test_gdpo_refuses_keys_that_reshape_the_combined_score():
    cfg = _cfg("roll_gspo.workers.rewards.IFEvalRewardWorker", gdpo_reward_keys=["prompt_level_strict_acc"],
               reward_norm="group", reward_clip=5.0, add_token_level_kl=True)
    cfg.rewards["math"].response_length_penalty_coef = 0.1
    assert sorted(k for k, _ in _errors(cfg)) == ["add_token_level_kl", "reward_clip", "reward_norm",
                                                 "rewards.math.response_length_penalty_coef"]


def test_a_users_worker_is_warned_not_refused():
    from roll_gspo.config.checks.rewards import _gdpo_unknown_components

    cfg = _cfg("my_pkg.rewards.MyWorker")
    assert _errors(cfg) == []
    assert [f.key for f in _gdpo_unknown_components(cfg)] == ["rewards.math.worker_cls"]
    cfg = _cfg("roll_gspo.workers.rewards.FunctionRewardWorker")
    assert _errors(cfg) == []


def test_other_estimators_ignore_the_gdpo_keys():
    cfg = _cfg(adv_estimator="grpo", reward_norm="group")
    assert _errors(cfg) == []


# --------------------------------------------------------------------------------------------
# The RLVR source: its advantages read the scored batch's components
# --------------------------------------------------------------------------------------------
def test_the_rlvr_source_builds_gdpo_advantages_from_reward_metrics():
    from roll_gspo.distributed.batch import Batch

    from pipelines.rlvr_pipeline import PromptGroupSource

    comps, mask = _random_batch(5, 3, 4, 2)
    statuses = ["ok"] * 12
    metrics = [{"accuracy": float(a), "format_rate": float(f), "answer_score": 0.0, "truncated": 0.0}
               for a, f in comps.tolist()]
    metrics[5], statuses[5] = None, "format"  # scored 0 without the scorer: every component 0
    comps[5] = 0.0
    batch = Batch({"scores": comps.sum(-1).float(), "response_mask": mask.float()},
                  {"reward_metrics": metrics, "reward_status": statuses, "domain": ["arith"] * 12})
    source = PromptGroupSource.__new__(PromptGroupSource)
    source.cfg = PipelineConfig(adv_estimator="gdpo", num_return_sequences_in_group=4,
                                gdpo_reward_weights=[1.0, 0.5])
    source.running_stats = None
    advantages, found = source.advantages(batch)
    expected = verl_gdpo_reference(comps, mask, np.repeat(np.arange(3), 4), [1.0, 0.5], EPS)
    torch.testing.assert_close(advantages.double(), expected, atol=1e-6, rtol=0)
    assert found["critic/gdpo/format_rate_mean"] == pytest.approx(float(comps[:, 1].mean()))
    metrics[0] = {"accuracy": 1.0}
    with pytest.raises(ValueError, match=r"domain 'arith'.*format_rate"):
        source.advantages(batch)
