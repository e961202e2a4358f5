"""Training metrics do not change with the micro-batch / rank split: the pure
level (policy_loss + kl_loss shares through SplitInvariantMetrics, ranks simulated)."""
import pytest
import torch

from roll_gspo.algorithms import kl_loss, policy_loss
from roll_gspo.workers.train_metrics import SplitInvariantMetrics

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def mini_batch(seed=0, rows=8, width=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])[:rows]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    old = -torch.rand(rows, width, generator=g) * 3
    logp = old + torch.randn(rows, width, generator=g) * 0.05
    ref = old + torch.randn(rows, width, generator=g) * 0.2
    adv = torch.randn(rows, 1, generator=g).expand(rows, width).clone()
    return logp, old, adv, ref, mask


def split_metrics(split, mode):
    """`split`: per rank, a list of micro-batches (row lists) of one mini-batch."""
    logp, old, adv, ref, mask = mini_batch()
    num_seqs = float((mask.sum(-1) > 0).sum())
    num_tokens = float(mask.sum())
    ranks = []
    for micros in split:
        metrics = SplitInvariantMetrics()
        for rows in micros:
            m = mask[rows]
            _, pg = policy_loss(logp[rows], old[rows], adv[rows], m, clip_low=0.02, clip_high=0.03,
                                loss_agg_mode=mode, num_seqs=num_seqs, num_tokens=num_tokens, norm_length=6)
            _, kl = kl_loss(logp[rows], ref[rows], m, loss_agg_mode=mode, num_seqs=num_seqs,
                            num_tokens=num_tokens, norm_length=6)
            metrics.add_micro({**pg, **kl}, float(m.sum()))
        metrics.end_mini_batch()
        metrics.add_step({"actor/lr": 1e-3})
        ranks.append(metrics)
    local = []
    for metrics in ranks:  # simulated all-reduce: every rank gets the sum of all ranks' vectors
        metrics.reduce(lambda values: local.append(list(values)) or values)
    total = [sum(column) for column in zip(*local)]
    return [metrics.reduce(lambda values: total) for metrics in ranks]


@pytest.mark.parametrize("mode", MODES)
def test_logged_losses_and_token_means_do_not_depend_on_the_split(mode):
    logp, old, adv, ref, mask = mini_batch()
    whole_loss, whole = policy_loss(logp, old, adv, mask, clip_low=0.02, clip_high=0.03, loss_agg_mode=mode,
                                    norm_length=6)
    whole_kl, whole_kl_metrics = kl_loss(logp, ref, mask, loss_agg_mode=mode, norm_length=6)
    splits = {
        "one rank, one micro-batch": [[list(range(8))]],
        "one rank, four micro-batches": [[[0, 1], [2, 3], [4, 5], [6, 7]]],
        "two ranks x two micro-batches": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
        "four ranks, uneven micro-batches": [[[0], [1]], [[2, 3]], [[4], [5]], [[6, 7]]],
    }
    for name, split in splits.items():
        per_rank = split_metrics(split, mode)
        def shared(r):
            return {k: v for k, v in r.items() if not k.endswith(("_min", "_max"))}
        assert all(shared(r) == shared(per_rank[0]) for r in per_rank), name  # the global values
        got = per_rank[0]
        assert got["actor/pg_loss"] == pytest.approx(float(whole_loss), rel=1e-5, abs=1e-7), name
        assert got["actor/kl_loss"] == pytest.approx(float(whole_kl), rel=1e-5, abs=1e-7), name
        for key in ("actor/clipfrac", "actor/ratio_mean", "actor/ppo_kl", "actor/dual_clipfrac"):
            assert got[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), (name, key)
        assert got["actor/kl_mean"] == pytest.approx(whole_kl_metrics["actor/kl_mean"], rel=1e-5), name
        ratio_min = min(r["actor/ratio_min"] for r in per_rank)  # the driver takes extremes over ranks
        assert ratio_min == pytest.approx(whole["actor/ratio_min"], rel=1e-6), name
        assert got["actor/lr"] == 1e-3


def test_loss_is_averaged_over_mini_batches_not_summed():
    metrics = SplitInvariantMetrics()
    for loss in (0.2, 0.4):
        metrics.add_micro({"actor/pg_loss": loss / 2, "actor/clipfrac": 0.5}, 3.0)
        metrics.add_micro({"actor/pg_loss": loss / 2, "actor/clipfrac": 0.0}, 1.0)
        metrics.end_mini_batch()
    result = metrics.reduce(lambda values: values)
    assert result["actor/pg_loss"] == pytest.approx(0.3)
    assert result["actor/clipfrac"] == pytest.approx(0.375)  # 3 of 8 tokens
