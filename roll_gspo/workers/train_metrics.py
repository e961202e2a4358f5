"""Training metrics that do not depend on how a mini-batch is split over micro-batches and ranks.

Each micro-batch's loss carries its share of the whole mini-batch's normaliser (all ranks, all
micro-batches), so the mini-batch loss is the SUM of the shares; averaging them (as a plain mean
over micro-batches and then ranks would) reports the loss divided by
gradient_accumulation_steps x world_size. Token-level means (clip fractions, ratio mean, KL
mean, entropy, ...) are weighted by each micro-batch's valid tokens, so they equal the metric over
all tokens whatever the split. One all-reduce per train call makes every rank report the same
global values.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List

# Values a micro-batch reports as its share of the mini-batch loss (see aggregate_loss).
LOSS_SHARE_KEYS = frozenset({"actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "critic/vf_loss"})


def _is_extreme(key: str) -> bool:
    return key.endswith("_min") or key.endswith("_max")


class SplitInvariantMetrics:
    """Accumulates one train call's metrics on one rank; `reduce` combines all ranks.

    * ``add_micro(metrics, tokens)``: a micro-batch's metrics (python floats) and its valid-token
      count. Keys in ``LOSS_SHARE_KEYS`` are summed (reported: mean over mini-batches of the
      mini-batch loss); ``*_min`` / ``*_max`` keep extremes (the driver takes them over ranks);
      every other key is a token mean, weighted by ``tokens``.
    * ``add_step(metrics)``: per optimizer step values (grad norm, learning rate), averaged.
    * ``end_mini_batch()``: once per mini-batch, on every rank.
    """

    def __init__(self) -> None:
        self.loss_sums: Dict[str, float] = defaultdict(float)
        self.weighted: Dict[str, float] = defaultdict(float)
        self.weights: Dict[str, float] = defaultdict(float)
        self.extremes: Dict[str, float] = {}
        self.steps: Dict[str, List[float]] = defaultdict(list)
        self.mini_batches = 0

    def add_micro(self, metrics: Dict[str, float], tokens: float) -> None:
        for key, value in metrics.items():
            if key in LOSS_SHARE_KEYS:
                self.loss_sums[key] += value
            elif _is_extreme(key):
                if tokens:  # an empty micro-batch has no extreme (policy_loss reports 1.0)
                    pick = min if key.endswith("_min") else max
                    self.extremes[key] = pick(self.extremes.get(key, value), value)
            else:
                self.weighted[key] += value * tokens
                self.weights[key] += tokens

    def add_step(self, metrics: Dict[str, float]) -> None:
        for key, value in metrics.items():
            self.steps[key].append(value)

    def end_mini_batch(self) -> None:
        self.mini_batches += 1

    def reduce(self, all_reduce_sum: Callable[[List[float]], List[float]]) -> Dict[str, float]:
        """Global metrics. ``all_reduce_sum`` sums a list of floats over ranks (identity on one
        rank); every rank must call this with the same keys, which the shared loop guarantees."""
        loss_keys, mean_keys = sorted(self.loss_sums), sorted(self.weighted)
        local = ([self.loss_sums[k] for k in loss_keys] + [self.weighted[k] for k in mean_keys]
                 + [self.weights[k] for k in mean_keys])
        total = all_reduce_sum(local) if local else []
        result: Dict[str, float] = {}
        for index, key in enumerate(loss_keys):
            result[key] = total[index] / max(1, self.mini_batches)
        offset = len(loss_keys)
        for index, key in enumerate(mean_keys):
            weight = total[offset + len(mean_keys) + index]
            if weight > 0:
                result[key] = total[offset + index] / weight
        result.update(self.extremes)
        result.update({k: sum(v) / len(v) for k, v in self.steps.items() if v})
        return result
