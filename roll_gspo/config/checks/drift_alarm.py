"""The drift alarm's keys (`drift_alarm`): every rule of them, in one place. The thresholds a run
takes are `roll_gspo.config.plan.drift_alarm`'s; the alarm is `roll_gspo.metrics.drift`."""
from __future__ import annotations

import math
from typing import AbstractSet, List, Optional

from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.config.plan.drift_alarm import drift_thresholds
from roll_gspo.schema.config import PipelineConfig

KEY = "drift_alarm"


@check("check", keys=(f"{KEY}.warn_gap", f"{KEY}.stop_gap"),
       doc="`drift_alarm`: `warn_gap` or `stop_gap` not a number > 0 (`stop_gap` may be `.inf`); the warn gap "
           "the run takes above its stop gap", name="drift_alarm.ranges")
def _ranges(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    block, problems = cfg.drift_alarm, []
    for name in ("warn_gap", "stop_gap"):
        value = getattr(block, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value) \
                or (name == "warn_gap" and math.isinf(value)):
            problems.append(error(f"{KEY}.{name}", f"{KEY}.{name} = {value!r} is refused: a mean per-token log-prob "
                                                   f"gap > 0{' (.inf: never stop)' if name == 'stop_gap' else ''}, "
                                                   f"or null for the run's precision's default"))
    if problems:
        return problems
    thresholds = drift_thresholds(cfg)
    if thresholds is not None and thresholds.warn > thresholds.stop:
        problems.append(error(f"{KEY}.warn_gap", f"{KEY}.warn_gap {thresholds.warn:g} is above the stop gap "
                                                 f"{thresholds.stop:g} this run takes ({KEY}.stop_gap; "
                                                 f"{thresholds.basis}): a step would stop before it warned"))
    return problems


@check("warn", keys=(f"{KEY}.stop_gap", "actor_infer.generating_args"),
       doc="`drift_alarm.stop_gap` null where the sampling keys make the engine report another quantity than the "
           "trainer's: the alarm warns only", name="drift_alarm.warn_only")
def _warn_only(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    thresholds = drift_thresholds(cfg)
    if thresholds is None or not math.isinf(thresholds.stop) or cfg.drift_alarm.stop_gap is not None:
        return []
    return [notice(f"{KEY}.stop_gap", f"the drift alarm warns only (never stops) in this run: {thresholds.basis}",
                   f"set {KEY}.stop_gap to stop on a gap anyway")]
