"""The rollout correction (`train_infer_correction`, verl's `rollout_correction`): whether it acts and its
arguments for `roll_gspo.algorithms.rollout_correction`. Its checks are `roll_gspo.config.checks.correction`'s."""
from __future__ import annotations

from roll_gspo.schema.config import PipelineConfig


def correction_enabled(cfg: PipelineConfig) -> bool:
    """The rollout correction acts: importance weights or at least one rejection rule."""
    correction = cfg.train_infer_correction
    return correction.is_weight.enabled or any(rule.enabled for rule in correction.filters)


def correction_arguments(cfg: PipelineConfig) -> dict:
    """Keywords of `roll_gspo.algorithms.rollout_correction` for this config (is_level,
    is_threshold, rejections)."""
    from roll_gspo.algorithms.rollout_correction import RejectionRule

    weight = cfg.train_infer_correction.is_weight
    rules = [RejectionRule(rule.agg_type, *((rule.ratio_low, rule.ratio_high) if rule.ratio_enabled else (None, None)),
                           *((rule.diff_low, rule.diff_high) if rule.diff_enabled else (None, None)))
             for rule in cfg.train_infer_correction.filters if rule.enabled]
    return {"is_level": weight.weight_type if weight.enabled else None,
            "is_threshold": weight.upper_bound if weight.enabled else None, "rejections": rules}
