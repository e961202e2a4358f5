"""The drift alarm's thresholds for a run (`drift_alarm`): what the trainer-vs-engine log-prob gap may
be, chosen from the run's precision when the keys are null. The alarm itself is
`roll_gspo.metrics.drift` (docs/algorithm.md#the-drift-alarm).

Measured on this machine (mean |trainer - engine| per token, before any update, 3 steps of
`example_gspo.yaml`, the built-in 1M model): fp32 on both sides 3.5-4.4e-7; bf16 on both sides
0.0026-0.0063; docs/training_speed.md has bf16 SmolLM2-135M at 0.038-0.047 and bf16 vLLM against an
fp32 trainer at 1.2e-3. The defaults leave a margin of 2000x (fp32 warn) and 2x the largest bf16
figure (half-precision warn); a stop is a gap no precision explains: 0.05 in fp32 (over ten times a
GSPO clip of 3e-3 per token), 0.5 in half precision (the per-token bound of bf16 kernel differences
as a mean).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

from roll_gspo.config.plan.engine_logprobs import engine_numerics_changes, rollout_logprobs_bias
from roll_gspo.metrics.drift import DriftThresholds
from roll_gspo.schema.config import PipelineConfig

FP32_GAPS = (1e-3, 5e-2)  # (warn, stop) with fp32 on both sides and the engine's own numerics
HALF_GAPS = (0.1, 0.5)  # either side in bf16 / fp16, or engine keys that change its numerics


def precision_basis(cfg: PipelineConfig) -> Tuple[bool, str]:
    """(exact, words): whether trainer and engine compute in fp32 with the same numerics, and the
    precision in words for the alarm line."""
    train, infer = cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype
    words = f"{train} on both sides" if train == infer else f"actor_train {train}, actor_infer {infer}"
    changes = engine_numerics_changes(cfg)
    if changes:
        return False, f"{words}, engine keys {', '.join(changes)}"
    return train == infer == "fp32", words


def drift_thresholds(cfg: PipelineConfig) -> Optional[DriftThresholds]:
    """The run's warn and stop gaps (None: no alarm, i.e. `drift_alarm.enabled: false` or no rollout
    engine). Null keys follow the precision; a null stop never stops where the sampling keys make the
    engine report another quantity than the trainer's (`rollout_logprobs_bias`: the gap is then
    the configuration's, warned about, not a fault)."""
    block = cfg.drift_alarm
    if not block.enabled or not cfg.has_rollout():
        return None
    exact, words = precision_basis(cfg)
    warn, stop = FP32_GAPS if exact else HALF_GAPS
    basis = words
    if rollout_logprobs_bias(cfg) is not None and block.stop_gap is None:
        stop, basis = math.inf, f"{words}; sampling keys the trainer does not follow: warn only"
    if block.warn_gap is not None:
        warn = float(block.warn_gap)
    if block.stop_gap is not None:
        stop = float(block.stop_gap)
    chosen = "auto" if block.warn_gap is None and block.stop_gap is None else "drift_alarm keys"
    return DriftThresholds(warn=warn, stop=stop, basis=f"{basis}; {chosen}", exact_precision=exact)
