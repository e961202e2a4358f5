"""Rollout correction (train_infer_correction / verl's rollout_correction): the importance weights and
rejection masks against hand values, the corrected policy loss (values and gradients) against an
independent per-row reference, rejection as if the rejected tokens had never been sampled (the loss
normalisers count kept tokens only, in the loss functions and in the trainer's micro-batch loop),
its metrics, the config checks, and one e2e run whose rollout engine (vLLM in bf16) differs from the
fp32 trainer on purpose."""
import json
import math

import pytest
import torch

from roll_gspo.algorithms import (LOSS_AGG_MODES, RejectionRule, kept_mask, kl_loss, loss_normalisers, policy_loss,
                                  rollout_correction)
from roll_gspo.algorithms.rollout_correction import SEQUENCE_MEAN_METRICS
from roll_gspo.config import ConfigError, load_config
from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source
from roll_gspo.config.plan.correction import correction_arguments
from roll_gspo.workers.train_metrics import SplitInvariantMetrics

DT = torch.float64


def batch(lengths=(3, 5, 1, 4), width=6, seed=0, gap=0.3):
    """log_probs (leaf), old, rollout (old plus a gap), per-response advantages, mask; NaN off the mask."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(DT)
    old = -torch.rand(len(lengths), width, generator=g, dtype=DT) * 2
    logp = (old + 0.02 * torch.randn(len(lengths), width, generator=g, dtype=DT)).requires_grad_()
    rollout = old + gap * torch.randn(len(lengths), width, generator=g, dtype=DT)
    adv = torch.randn(len(lengths), 1, generator=g, dtype=DT).expand(-1, width).clone()
    rollout = torch.where(mask > 0, rollout, torch.full_like(rollout, float("nan")))
    return logp, old, rollout, adv, mask


# --------------------------------------------------------------------------------------------
# Weights and masks: hand values
# --------------------------------------------------------------------------------------------
def test_weights_at_each_level_hand_values():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]], dtype=DT)
    rollout = torch.tensor([[-1.2, -1.9, -3.0], [-0.1, 7.0, 7.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=DT)
    token, _ = rollout_correction(old, rollout, mask, is_level="token")
    torch.testing.assert_close(token.weights, torch.tensor(
        [[math.exp(0.2), math.exp(-0.1), 1.0], [math.exp(-0.4), 1.0, 1.0]], dtype=DT))
    geometric, _ = rollout_correction(old, rollout, mask, is_level="geometric")
    g0 = math.exp(0.1 / 3)
    torch.testing.assert_close(geometric.weights, torch.tensor([[g0] * 3, [math.exp(-0.4), 1.0, 1.0]], dtype=DT))
    sequence, _ = rollout_correction(old, rollout, mask, is_level="sequence")
    torch.testing.assert_close(sequence.weights[0], torch.full((3,), math.exp(0.1), dtype=DT))
    assert token.keep.tolist() == [[True, True, True], [True, False, False]]


def test_truncation_counts_clipped_tokens():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=DT)
    rollout = torch.tensor([[-1.0, -0.1, 0.5, 0.0]], dtype=DT)  # weights e, 1.105, 0.607, 1
    mask = torch.ones(1, 4, dtype=DT)
    out, metrics = rollout_correction(old, rollout, mask, is_level="token", is_threshold=1.5)
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, math.exp(0.1), math.exp(-0.5), 1.0]], dtype=DT))
    assert metrics["rollout_correction/clipped_fraction"] == pytest.approx(0.25)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx((1.5 + math.exp(0.1) + math.exp(-0.5) + 1) / 4)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(1.5)
    assert metrics["rollout_correction/masked_fraction"] == 0.0


def test_rejection_rules_mask_tokens_or_whole_responses():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=DT)
    rollout = torch.tensor([[-0.5, 0.0, 0.0], [-0.05, -0.05, 0.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=DT)
    token, metrics = rollout_correction(old, rollout, mask, rejections=[RejectionRule("token", 0.9, 1.1)])
    assert token.keep.tolist() == [[False, True, True], [True, True, False]]
    assert metrics["rollout_correction/masked_fraction"] == pytest.approx(1 / 5)
    assert metrics["rollout_correction/weight_mean"] == 1.0  # no weights asked for
    # geometric: row 0's weight exp(0.5/3) = 1.18 is out, row 1's exp(0.05) is in
    seq, _ = rollout_correction(old, rollout, mask, rejections=[RejectionRule("geometric", 0.9, 1.1)])
    assert seq.keep.tolist() == [[False, False, False], [True, True, False]]
    # the probability difference of token 0 of row 0: 1 - exp(-0.5) = 0.39
    diff, _ = rollout_correction(old, rollout, mask, rejections=[RejectionRule("token", diff_low=-0.2, diff_high=0.2)])
    assert diff.keep.tolist() == [[False, True, True], [True, True, False]]
    # rules apply one after the other
    both, _ = rollout_correction(old, rollout, mask, rejections=[RejectionRule("token", 0.9, 1.1),
                                                                 RejectionRule("sequence", 0.9, 1.12)])
    assert both.keep.tolist() == [[False, False, False], [True, True, False]]


def test_threshold_at_or_below_one_is_refused():
    _, old, rollout, _, mask = batch()
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="must be > 1"):
            rollout_correction(old, rollout, mask, is_level="token", is_threshold=bad)
    with pytest.raises(ValueError, match="unknown rollout correction level"):
        rollout_correction(old, rollout, mask, is_level="segment")


# --------------------------------------------------------------------------------------------
# The corrected loss against an independent reference (values and gradients)
# --------------------------------------------------------------------------------------------
def reference_corrected_loss(logp, old, rollout, adv, mask, *, importance_sampling, agg, clip_low, clip_high,
                             level, threshold, reject):
    """Row by row, scalar by scalar: weight w (level, truncated), token kept unless its level's weight
    is outside `reject` = (level, low, high); loss_t = w * max(-A r, -A clip(r)) with GSPO's r the
    geometric mean over the kept tokens; a row's token mean over its kept tokens; the normalisers
    N_seqs / N_tokens count kept responses / kept tokens only (as verl's and ROLL's recompute path:
    a rejected token is as if never sampled)."""
    rows, width = mask.shape
    total = logp.new_zeros(())
    lengths = [int(mask[i].sum()) for i in range(rows)]
    kept_per_row = []
    for i in range(rows):
        n = lengths[i]
        gaps = [float(old[i, t] - rollout[i, t]) for t in range(n)]
        level_logs = [{"token": gaps[t], "geometric": sum(gaps) / max(n, 1), "sequence": sum(gaps)}
                      for t in range(n)]
        kept = [t for t in range(n)
                if reject is None or reject[1] <= math.exp(level_logs[t][reject[0]]) <= reject[2]]
        kept_per_row.append((kept, level_logs))
    n_seqs = sum(1 for kept, _ in kept_per_row if kept)
    n_tokens = sum(len(kept) for kept, _ in kept_per_row)
    for i in range(rows):
        kept, level_logs = kept_per_row[i]
        if not kept:
            continue
        if importance_sampling == "seq":
            seq_log = sum(logp[i, t] - old[i, t] for t in kept) / len(kept)
        row = logp.new_zeros(())
        for t in kept:
            w = math.exp(level_logs[t][level]) if level else 1.0
            if threshold is not None:
                w = min(w, threshold)
            ratio = torch.exp(seq_log if importance_sampling == "seq" else logp[i, t] - old[i, t])
            a = float(adv[i, t])
            unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high)
            row = row + w * (clipped if clipped > unclipped else unclipped)
        if agg == "token-mean":
            total = total + row / n_tokens
        elif agg == "seq-mean-token-sum":
            total = total + row / n_seqs
        elif agg == "seq-mean-token-mean":
            total = total + row / len(kept) / n_seqs
        else:
            total = total + row / (n_seqs * width)
    return total


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("importance_sampling", ["seq", "token"])
@pytest.mark.parametrize("level,threshold,reject", [
    ("token", 1.2, None), ("geometric", 1.05, None), ("sequence", None, None), ("geometric", 2.0, None),
    (None, None, ("token", 0.8, 1.25)), ("token", 1.5, ("geometric", 0.9, 1.1)),
])
def test_corrected_loss_and_gradient_match_reference(agg, importance_sampling, level, threshold, reject):
    logp, old, rollout, adv, mask = batch(seed=3)
    clip = dict(clip_low=0.2, clip_high=0.28) if importance_sampling == "token" else dict(clip_low=3e-3, clip_high=4e-3)
    rules = [RejectionRule(reject[0], reject[1], reject[2])] if reject else []
    correction, _ = rollout_correction(old, rollout, mask, is_level=level, is_threshold=threshold, rejections=rules)
    kept = kept_mask(mask, correction.keep)
    n_seqs, n_tokens = loss_normalisers(kept)  # kept responses / tokens only
    loss, _ = policy_loss(logp, old, adv, kept, importance_sampling=importance_sampling, loss_agg_mode=agg,
                          num_seqs=n_seqs, num_tokens=n_tokens, token_weights=correction.weights, **clip)
    expected = reference_corrected_loss(logp, old, rollout, adv, mask, importance_sampling=importance_sampling,
                                        agg=agg, level=level, threshold=threshold, reject=reject, **clip)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logp)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(grad, expected_grad)
    assert torch.isfinite(grad).all()  # NaN rollout log-probs off the mask never reach it
    if level is not None or reject is not None:  # the correction changes something here
        plain, _ = policy_loss(logp, old, adv, mask, importance_sampling=importance_sampling, loss_agg_mode=agg,
                               **clip)
        assert not torch.allclose(plain, loss)


def test_weights_of_one_leave_the_loss_unchanged():
    logp, old, _, adv, mask = batch(seed=5)
    correction, metrics = rollout_correction(old, old.clone(), mask, is_level="geometric", is_threshold=1.2,
                                             rejections=[RejectionRule("token", 0.99, 1.01)])
    base, _ = policy_loss(logp, old, adv, mask)
    corrected, _ = policy_loss(logp, old, adv, mask * correction.keep.to(DT), token_weights=correction.weights)
    torch.testing.assert_close(base, corrected)
    assert metrics["rollout_correction/kl"] == 0.0 and metrics["rollout_correction/chi2_seq"] == 0.0


# --------------------------------------------------------------------------------------------
# Rejection: as if the rejected tokens had never been sampled (normalisers of the kept tokens)
# --------------------------------------------------------------------------------------------
def test_loss_normalisers_count_kept_rows_and_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=DT)
    keep = torch.tensor([[True, False, True, True], [False, False, True, True], [True] * 4, [True] * 4])
    assert loss_normalisers(mask) == (3.0, 6.0)
    kept = kept_mask(mask, keep)
    assert kept.dtype == mask.dtype and kept.tolist() == [[1, 0, 1, 0], [0, 0, 0, 0], [0] * 4, [1, 0, 0, 0]]
    assert loss_normalisers(kept) == (2.0, 3.0)  # row 1 lost every token: out of N_seqs too
    assert loss_normalisers(kept > 0) == (2.0, 3.0)
    with pytest.raises(ValueError, match="differ in shape"):
        kept_mask(mask, keep[:, :3])


def compacted(tensors, keep, width):
    """The batch the rejected tokens were never part of: each row's kept tokens moved to its front
    (NaN after them), rows with none left out. Returns the tensors and, per kept row, (row, columns)."""
    index = [(i, keep[i].nonzero().flatten().tolist()) for i in range(len(keep)) if bool(keep[i].any())]
    out = []
    for tensor in tensors:
        rows = torch.full((len(index), width), float("nan"), dtype=tensor.dtype)
        for j, (i, cols) in enumerate(index):
            rows[j, :len(cols)] = tensor[i, cols].detach()
        out.append(rows)
    mask = torch.zeros(len(index), width, dtype=DT)
    for j, (_, cols) in enumerate(index):
        mask[j, :len(cols)] = 1
    return out, mask, index


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("importance_sampling", ["seq", "token"])
def test_rejected_tokens_leave_the_normalisers_as_if_never_sampled(agg, importance_sampling):
    """The trainer's accounting in pure functions: normalisers of the whole mini-batch on the kept
    mask, the loss summed over micro-batches. Its value and gradient on the kept tokens are those of
    the batch the rejected tokens and responses were never part of (plain losses, default
    normalisers); the normalisers of the unmasked batch would shrink the step by the kept fraction."""
    logp, old, rollout, adv, mask = batch(lengths=(3, 5, 1, 4, 6, 2, 5, 4), width=6, seed=13, gap=0.25)
    ref = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    correction, metrics = rollout_correction(old, rollout, mask, is_level="token", is_threshold=1.3,
                                             rejections=[RejectionRule("token", 0.8, 1.25),
                                                         RejectionRule("geometric", 0.85, 1.18)])
    keep = correction.keep
    assert 0.15 < metrics["rollout_correction/masked_fraction"] < 0.6  # a real rejection ...
    assert 0 < metrics["rollout_correction/masked_seq_fraction"] < 1   # ... of whole responses too
    assert keep.any()
    clip = dict(clip_low=0.2, clip_high=0.28) if importance_sampling == "token" else dict(clip_low=3e-3, clip_high=4e-3)
    width = mask.shape[1]
    loss_args = dict(loss_agg_mode=agg, norm_length=width)

    def step_loss(normaliser_mask):
        """Micro-batches of rows [0, 3), [3, 5), [5, 8) summed; the normalisers of `normaliser_mask`."""
        n_seqs, n_tokens = loss_normalisers(normaliser_mask)
        total = logp.new_zeros(())
        for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):
            kept = kept_mask(mask[rows], keep[rows])
            pg, _ = policy_loss(logp[rows], old[rows], adv[rows], kept, importance_sampling=importance_sampling,
                                num_seqs=n_seqs, num_tokens=n_tokens, token_weights=correction.weights[rows],
                                **clip, **loss_args)
            kl, _ = kl_loss(logp[rows], ref[rows], kept, num_seqs=n_seqs, num_tokens=n_tokens, **loss_args)
            total = total + pg + 0.1 * kl
        return total

    loss = step_loss(kept_mask(mask, keep))
    (grad,) = torch.autograd.grad(loss, logp)
    # The batch without the rejected tokens, from scratch.
    (c_logp, c_old, c_adv, c_ref, c_weights), c_mask, index = compacted(
        [logp, old, adv, ref, correction.weights], keep, width)
    c_logp.requires_grad_()
    pg, _ = policy_loss(c_logp, c_old, c_adv, c_mask, importance_sampling=importance_sampling,
                        token_weights=c_weights, **clip, **loss_args)
    kl, _ = kl_loss(c_logp, c_ref, c_mask, **loss_args)
    expected = pg + 0.1 * kl
    (expected_grad,) = torch.autograd.grad(expected, c_logp)
    torch.testing.assert_close(loss, expected)
    for j, (i, cols) in enumerate(index):
        torch.testing.assert_close(grad[i, cols], expected_grad[j, :len(cols)])
    assert float(grad[~keep].abs().max()) == 0.0  # rejected tokens get no gradient
    # Counting the rejected tokens as well (what the trainer did) shrinks the step.
    if agg != "seq-mean-token-sum-norm" or len(index) < int((mask.sum(-1) > 0).sum()):
        (shrunk,) = torch.autograd.grad(step_loss(mask), logp)
        assert float(shrunk.norm()) < 0.95 * float(grad.norm())


def test_trainer_step_with_rejection_equals_the_step_without_the_rejected_tokens(tiny_model):
    """The trainer's own micro-batch loop (ActorTrainWorker.train_step on the micro model, a one-rank
    strategy standing in for DeepSpeed): with the rollout correction rejecting ~1/4 of the tokens
    (some responses whole), every mini-batch's gradient, and the logged losses, equal those of the
    same step where the rejected tokens were never in the loss (`loss_mask`, no correction), for
    every loss_agg_mode. Before the normalisers counted kept tokens only, the step shrank by the kept
    fraction (token-mean: N_kept / N_all)."""
    from roll_gspo.schema.config import PipelineConfig
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.models.causal_lm import load_causal_lm
    from roll_gspo.workers.actor_train import ActorTrainWorker
    from tests.test_dynamic_batching import OneRankStrategy, sequences

    data = sequences(12, seed=21)
    mask = data["response_mask"].bool()
    g = torch.Generator().manual_seed(5)
    rejected = mask & (torch.rand(mask.shape, generator=g) < 0.15)
    rejected[[2, 7]] = mask[[2, 7]]  # two whole responses
    # A token band [0.8, 1.25] on w = exp(old - rollout): w = e on the rejected tokens, 1 elsewhere.
    data["rollout_log_probs"] = data["old_log_probs"] - rejected.float()
    keep = mask & ~rejected
    fraction = float(rejected.sum() / mask.sum())
    whole = float((mask.any(-1) & ~keep.any(-1)).sum() / mask.any(-1).sum())
    assert 0.2 < fraction < 0.35 and whole >= 2 / 12

    def step(correction, batch_tensors, mode):
        cfg = PipelineConfig()
        cfg.loss_agg_mode, cfg.loss_norm_length, cfg.use_kl_loss, cfg.kl_loss_coef = mode, 12, True, 0.1
        cfg.entropy_loss_coef, cfg.ppo_epochs, cfg.pg_clip_low, cfg.pg_clip_high = 0.01, 1, 0.02, 0.03
        role = cfg.actor_train
        role.training_args.per_device_train_batch_size, role.training_args.gradient_accumulation_steps = 3, 2
        model = load_causal_lm(tiny_model)
        worker = ActorTrainWorker.__new__(ActorTrainWorker)  # the rank without its Ray/DeepSpeed set-up
        worker.cfg, worker.role, worker.rank, worker.temperature = cfg, role, 0, 0.7
        worker.moe, worker.offload, worker.correction = None, False, correction
        worker.engine, worker.strategy = model, OneRankStrategy(model)
        metrics = worker.train_step(Batch(dict(batch_tensors)))
        return worker.strategy.step_grads, metrics

    rule = {"is_level": None, "is_threshold": None, "rejections": [RejectionRule("token", 0.8, 1.25)]}
    without = dict(data.tensors, loss_mask=keep.to(data["response_mask"].dtype))
    scales = {}
    for mode in LOSS_AGG_MODES:
        got_grads, got = step(rule, data.tensors, mode)
        want_grads, want = step(None, without, mode)
        assert len(got_grads) == len(want_grads) == 2  # two mini-batches of 6 rows
        for got_step, want_step in zip(got_grads, want_grads):
            for name in want_step:
                torch.testing.assert_close(got_step[name], want_step[name], rtol=1e-4, atol=1e-7, msg=name)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/clipfrac", "actor/kl_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), (mode, key)
        assert got["rollout_correction/masked_fraction"] == pytest.approx(fraction)
        assert got["rollout_correction/masked_seq_fraction"] == pytest.approx(whole)
        norm = lambda grads: sum(float(g.square().sum()) for s in grads for g in s.values()) ** 0.5  # noqa: E731
        scales[mode] = norm(got_grads) / norm(want_grads)
    assert all(s == pytest.approx(1.0, rel=1e-4) for s in scales.values()), scales


# --------------------------------------------------------------------------------------------
# Metrics: the gap's estimates, and split invariance through the trainer's accumulator
# --------------------------------------------------------------------------------------------
def test_gap_metrics_match_their_definitions():
    _, old, rollout, _, mask = batch(seed=7, gap=0.2)
    _, metrics = rollout_correction(old, rollout, mask)
    valid = mask > 0
    log_w = (old - rollout)[valid]
    assert metrics["rollout_correction/kl"] == pytest.approx(float((-log_w).mean()))
    assert metrics["rollout_correction/k3_kl"] == pytest.approx(float((log_w.exp() - log_w - 1).mean()))
    assert metrics["rollout_correction/chi2_token"] == pytest.approx(float((2 * log_w).exp().mean() - 1))
    per_row = [float((old[i] - rollout[i])[valid[i]].sum()) for i in range(len(mask))]
    lengths = mask.sum(-1).tolist()
    assert metrics["rollout_correction/chi2_seq"] == pytest.approx(
        sum(math.exp(2 * s) - 1 for s in per_row) / len(per_row))
    assert metrics["rollout_correction/log_ppl_diff"] == pytest.approx(
        sum(-s / n for s, n in zip(per_row, lengths)) / len(per_row))
    assert metrics["rollout_correction/k3_kl"] > 0


def test_metrics_are_split_invariant_through_the_trainer_accumulator():
    _, old, rollout, _, mask = batch(lengths=(3, 5, 1, 4, 6, 2), seed=11)
    args = dict(is_level="token", is_threshold=1.1, rejections=[RejectionRule("geometric", 0.85, 1.2)])
    _, whole = rollout_correction(old, rollout, mask, **args)
    acc = SplitInvariantMetrics()
    for rows in ([0, 1], [2, 3, 4], [5]):  # what ActorTrainWorker._apply_rollout_correction adds
        _, part = rollout_correction(old[rows], rollout[rows], mask[rows], **args)
        acc.add_micro({k: v for k, v in part.items() if k not in SEQUENCE_MEAN_METRICS}, float(mask[rows].sum()))
        acc.add_micro({k: v for k, v in part.items() if k in SEQUENCE_MEAN_METRICS},
                      float((mask[rows].sum(-1) > 0).sum()))
    acc.end_mini_batch()
    reduced = acc.reduce(lambda values: values)
    for key, value in whole.items():
        assert reduced[key] == pytest.approx(value), key
    assert whole["rollout_correction/masked_fraction"] > 0 and whole["rollout_correction/clipped_fraction"] > 0


# --------------------------------------------------------------------------------------------
# Config: ROLL's keys, verl's names, bad input
# --------------------------------------------------------------------------------------------
BASE = """\
actor_train:
  training_args: {per_device_train_batch_size: 8, gradient_accumulation_steps: 1}
  data_args: {file_name: [builtin:arith/train]}
rollout_batch_size: 4
num_return_sequences_in_group: 2
prompt_length: 64
response_length: 64
"""


def load(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + text)
    return load_config(str(path))


def refusal(tmp_path, text):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    return str(info.value)


def test_roll_keys_load_and_take_the_trainer_old_logprobs_where_they_differ(tmp_path):
    cfg = load(tmp_path, """\
train_infer_correction:
  is_weight: {enabled: true, weight_type: geometric, upper_bound: 1.5}
  filters:
    - {enabled: true, agg_type: token, ratio_low: 0.5, ratio_high: 2.0, diff_enabled: true}
""")
    args = correction_arguments(cfg)
    assert args["is_level"] == "geometric" and args["is_threshold"] == 1.5
    assert args["rejections"] == [RejectionRule("token", 0.5, 2.0, -0.2, 0.2)]
    # fp32 on both sides: the weights would be exp(~1e-6), so auto skips the trainer's pass
    choice = choose_old_logprob_source(cfg)
    assert choice.source == "rollout" and "nothing to correct" in choice.reason
    assert choose_old_logprob_source(load(tmp_path, "")).source == "rollout"
    bf16 = load(tmp_path, """\
train_infer_correction: {is_weight: {enabled: true, weight_type: geometric, upper_bound: 1.5}}
actor_infer: {model_args: {dtype: bf16}}
""")
    choice = choose_old_logprob_source(bf16)  # the weights need both every step: never follows the gap
    assert choice.source == "trainer" and choice.max_gap is None and "train_infer_correction" in choice.reason
    stale = load(tmp_path, """\
train_infer_correction: {is_weight: {enabled: true, weight_type: geometric}}
model_update_frequency: 2
""")
    assert choose_old_logprob_source(stale).source == "trainer"  # the weights carry the staleness


def test_verl_names_set_the_roll_block(tmp_path):
    cfg = load(tmp_path, """\
rollout_correction: {rollout_is: sequence, rollout_is_threshold: 3.0, rollout_rs: geometric, rollout_rs_threshold: 1.25}
""")
    weight = cfg.train_infer_correction.is_weight
    assert (weight.enabled, weight.weight_type, weight.upper_bound) == (True, "sequence", 3.0)
    (rule,) = cfg.train_infer_correction.filters
    assert (rule.enabled, rule.agg_type, rule.ratio_high) == (True, "geometric", 1.25)
    assert rule.ratio_low == pytest.approx(0.8) and not rule.diff_enabled
    # a printed (resolved) config holds both blocks, saying the same: it loads again
    again = load(tmp_path, """\
rollout_correction: {rollout_is: sequence, rollout_is_threshold: 3.0, rollout_rs: geometric, rollout_rs_threshold: 1.25}
train_infer_correction:
  is_weight: {enabled: true, weight_type: sequence, upper_bound: 3.0, detach: true}
  filters: [{enabled: true, agg_type: geometric, ratio_enabled: true, ratio_low: 0.8, ratio_high: 1.25,
             diff_enabled: false, diff_low: -0.2, diff_high: 0.2}]
""")
    assert again.train_infer_correction == cfg.train_infer_correction


def test_stale_rollouts_warn_only_without_the_correction(tmp_path):
    from roll_gspo.config import validate_config

    stale = "model_update_frequency: 2\n"
    assert any("model_update_frequency = 2" in w for w in validate_config(load(tmp_path, stale)))
    corrected = load(tmp_path, stale + "train_infer_correction: {is_weight: {enabled: true, weight_type: geometric}}\n")
    assert not any("model_update_frequency = 2" in w for w in validate_config(corrected))


@pytest.mark.parametrize("text,expected", [
    ("train_infer_correction: {is_weight: {enabled: true, upper_bound: 1.0}}", "upper_bound"),
    ("rollout_correction: {rollout_is: token, rollout_is_threshold: 0.9}", "rollout_is_threshold"),
    ("train_infer_correction: {filters: [{enabled: true, ratio_high: 0.95}]}", "ratio_high"),
    ("train_infer_correction: {filters: [{enabled: true, ratio_low: 1.0}]}", "ratio_low"),
    ("train_infer_correction: {filters: [{enabled: true, ratio_enabled: false}]}", "rejects nothing"),
    ("train_infer_correction: {filters: [{enabled: true, diff_enabled: true, diff_low: 0.1}]}", "diff_low < 0"),
    ("train_infer_correction: {is_weight: {enabled: true, weight_type: segment}}", "segment"),
    ("rollout_correction: {rollout_rs: token}", "rollout_rs_threshold"),
    ("rollout_correction: {rollout_is: token}\n"
     "train_infer_correction: {is_weight: {enabled: true, weight_type: geometric}}", "keep one"),
    ("train_infer_correction: {is_weight: {enabled: true}}\nold_logprob_source: rollout",
     "every weight exp(old_logp - rollout_logp) would be 1"),
    ("train_infer_correction: {is_weight: {enabled: true}}\nasync_generation_ratio: 1", "async_generation_ratio"),
])
def test_bad_correction_configs_are_refused(tmp_path, text, expected):
    assert expected in refusal(tmp_path, text + "\n")


# --------------------------------------------------------------------------------------------
# e2e: vLLM in bf16, trainer in fp32
# --------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_bf16_rollout_engine_shows_the_gap_and_the_correction(tmp_path, tiny_model, ray_session):
    """vLLM samples in bf16 while the trainer scores in fp32: the measured gap, truncated and rejected
    tokens, and the trainer's old-log-prob pass forced by the correction (auto would follow the gap)."""
    from omegaconf import OmegaConf

    from pipelines.rlvr_pipeline import run_rlvr

    config = {
        "exp_name": "rollout_correction", "output_dir": str(tmp_path / "out"), "pretrain": tiny_model, "seed": 1,
        "max_steps": 2, "eval_steps": 0, "save_steps": 0, "track_with": "none", "adv_estimator": "grpo",
        "rollout_batch_size": 4, "num_return_sequences_in_group": 2, "prompt_length": 16, "response_length": 6,
        "pg_clip_low": 3e-3, "pg_clip_high": 4e-3,
        # bf16 moves a token's log-prob by ~1e-3 here (a random micro model), so the bounds are tight
        "train_infer_correction": {"is_weight": {"enabled": True, "weight_type": "token", "upper_bound": 1.001},
                                   "filters": [{"enabled": True, "agg_type": "token", "ratio_low": 0.999,
                                                "ratio_high": 1.002}]},
        "actor_train": {"training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": 8,
                                          "gradient_accumulation_steps": 1},
                        "data_args": {"file_name": ["builtin:arith/train"]}, "world_size": 1,
                        "num_cpus_per_worker": 0.5},
        "actor_infer": {"model_args": {"dtype": "bf16"},
                        "strategy_args": {"strategy_name": "vllm",
                                          "strategy_config": {"max_model_len": 32, "enforce_eager": True}},
                        "num_cpus_per_worker": 0.5},
        "rewards": {"math_rule": {"worker_cls": "roll_gspo.workers.rewards.FunctionRewardWorker",
                                  "reward_fn": "tests.reward_fns:digit_fraction", "num_cpus_per_worker": 0.25}},
    }
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(config), path)
    cfg = load_config(str(path))
    run_rlvr(cfg)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["rollout/old_logprobs_from_rollout"] == 0.0  # the correction forces the trainer's pass
        assert record["rollout/logprob_gap"] > 1e-4  # bf16 against fp32: a real gap (fp32 on both sides: ~1e-5)
        assert record["rollout_correction/k3_kl"] > 0 and record["rollout_correction/chi2_token"] != 0
        assert 0 < record["rollout_correction/clipped_fraction"] < 1
        assert 0 < record["rollout_correction/masked_fraction"] < 1
        assert record["rollout_correction/weight_max"] <= 1.001 + 1e-6
        assert math.isfinite(record["actor/pg_loss"])


@pytest.mark.parametrize("engine_key", ["kv_cache_dtype: fp8", "quantization: fp8",
                                        "logits_processors: ['my_pkg.processors:NoRepeat']"])
def test_engine_keys_that_change_numerics_make_the_rollout_logprobs_inexact(tmp_path, engine_key):
    """fp32 on both sides is not enough; an fp8 KV cache, quantized weights or a
    logits processor change what vLLM computes, so `auto` keeps the trainer's pass (named why)."""
    key = engine_key.split(":")[0]
    corrected = load(tmp_path, f"""\
train_infer_correction: {{is_weight: {{enabled: true, weight_type: geometric}}}}
actor_infer: {{strategy_args: {{strategy_config: {{{engine_key}}}}}}}
""")
    choice = choose_old_logprob_source(corrected)
    assert choice.source == "trainer", choice.reason
    token = load(tmp_path, f"""\
importance_sampling: token
actor_infer: {{strategy_args: {{strategy_config: {{{engine_key}}}}}}}
""")
    choice = choose_old_logprob_source(token)
    assert choice.source == "trainer" and key in choice.reason, choice.reason
