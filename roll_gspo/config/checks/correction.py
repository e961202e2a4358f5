"""The rollout correction (`train_infer_correction`, verl's `rollout_correction`): whether it acts,
its arguments for `roll_gspo.algorithms.rollout_correction`, and the checks of its keys."""
from __future__ import annotations

from typing import List

from roll_gspo.config.findings import Finding, error
from roll_gspo.config.checks.registry import check
from roll_gspo.config.plan.correction import correction_enabled
from roll_gspo.schema.config import PipelineConfig


@check("check", keys=("train_infer_correction",),
       doc="the rollout correction (`train_infer_correction`): per-turn (`segment`) weights or rejection, an "
           "`upper_bound` / `ratio_high` at or below 1, a band without 1, a rule that rejects nothing, and "
           "`old_logprob_source: rollout` (every weight would be 1)", name="train_infer_correction.keys")
def rollout_correction_problems(cfg: PipelineConfig, yaml_keys=None) -> List[Finding]:
    """Bad train_infer_correction values, and what the correction cannot run with."""
    if not cfg.has_rollout():
        return []
    problems: List[Finding] = []
    weight = cfg.train_infer_correction.is_weight
    key = "train_infer_correction.is_weight"
    if weight.enabled and weight.weight_type == "segment":
        problems.append(error(f"{key}.weight_type", f"{key}.weight_type = 'segment' is refused: per-turn weights are "
                                                    f"not built; use token, geometric (GSPO's length-normalised "
                                                    f"sequence weight) or sequence"))
    if weight.enabled and weight.upper_bound is not None and not weight.upper_bound > 1.0:
        problems.append(error(f"{key}.upper_bound", f"{key}.upper_bound (verl: "
                                                    f"rollout_correction.rollout_is_threshold) must be > 1 or null, "
                                                    f"got {weight.upper_bound}: a bound at or below 1 truncates every "
                                                    f"weight the trainer favours, which biases the loss towards what "
                                                    f"the rollout engine over-samples"))
    for index, rule in enumerate(cfg.train_infer_correction.filters):
        key = f"train_infer_correction.filters[{index}]"
        if not rule.enabled:
            continue
        if rule.agg_type == "segment":
            problems.append(error(f"{key}.agg_type", f"{key}.agg_type = 'segment' is refused: per-turn rejection is "
                                                     f"not built; use token, geometric or sequence"))
        if not (rule.ratio_enabled or rule.diff_enabled):
            problems.append(error(key, f"{key}: enabled with ratio_enabled and diff_enabled both false rejects "
                                       f"nothing; enable one test or remove the rule"))
        if rule.ratio_enabled and not 0.0 <= rule.ratio_low < 1.0:
            problems.append(error(f"{key}.ratio_low", f"{key}.ratio_low must be in [0, 1), got {rule.ratio_low}: the "
                                                      f"band must hold weight 1 (engines that agree)"))
        if rule.ratio_enabled and not rule.ratio_high > 1.0:
            problems.append(error(f"{key}.ratio_high", f"{key}.ratio_high (verl: "
                                                       f"rollout_correction.rollout_rs_threshold) must be > 1, got "
                                                       f"{rule.ratio_high}: a bound at or below 1 rejects every sample "
                                                       f"the trainer favours"))
        if rule.diff_enabled and not rule.diff_low < 0.0 < rule.diff_high:
            problems.append(error(f"{key}.diff_low", f"{key}: diff_low < 0 < diff_high is required (engines that agree "
                                                     f"differ by 0), got [{rule.diff_low}, {rule.diff_high}]"))
    if not correction_enabled(cfg):
        return problems
    if cfg.old_logprob_source == "rollout":
        problems.append(error("old_logprob_source", "train_infer_correction (or rollout_correction) needs the "
                                                    "trainer's old log-probs: with old_logprob_source: rollout the old "
                                                    "policy IS the rollout engine's, every weight exp(old_logp - "
                                                    "rollout_logp) would be 1 and the correction would do nothing; use "
                                                    "old_logprob_source: trainer or auto (which takes the trainer's "
                                                    "with the correction on)"))
    return problems
