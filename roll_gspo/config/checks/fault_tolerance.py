"""Replacing rollout ranks and reward workers, and resuming after a training rank died
(`fault_tolerance`): every rule of its keys, in one place. What the keys do at run time is
`roll_gspo.distributed.fault_tolerance`'s (docs/crash_safety.md)."""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.config.findings import Finding, error, warning
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig

KEY = "fault_tolerance"


SECONDS = ("hang_timeout_s", "reward_timeout_s", "phase_timeout_factor", "phase_timeout_floor_s", "collective_timeout_s")


@check("check", keys=(f"{KEY}.max_restarts", *(f"{KEY}.{name}" for name in SECONDS), f"{KEY}.auto_resume_on_failure"),
       doc="`fault_tolerance`: `max_restarts` or `auto_resume_on_failure` not an integer >= 0; `hang_timeout_s`, "
           "`reward_timeout_s`, `phase_timeout_factor`, `phase_timeout_floor_s` or `collective_timeout_s` not > 0",
       name="fault_tolerance.ranges")
def _ranges(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    fault, problems = cfg.fault_tolerance, []
    for name in ("max_restarts", "auto_resume_on_failure"):
        value = getattr(fault, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(error(f"{KEY}.{name}", f"{KEY}.{name} = {value!r} is refused: an integer >= 0"))
    for name in SECONDS:
        value = getattr(fault, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            what = "a number > 0" if name == "phase_timeout_factor" else "seconds > 0"
            problems.append(error(f"{KEY}.{name}", f"{KEY}.{name} = {value!r} is refused: {what}"))
    return problems


@check("warn", keys=(f"{KEY}.auto_resume_on_failure", "save_steps"),
       doc="`fault_tolerance.auto_resume_on_failure` without `save_steps`: no checkpoint to resume from before the end",
       name="fault_tolerance.resume_needs_checkpoints")
def _resume_without_checkpoints(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if cfg.fault_tolerance.auto_resume_on_failure and not cfg.save_steps:
        return [warning(f"{KEY}.auto_resume_on_failure",
                        f"{KEY}.auto_resume_on_failure = {cfg.fault_tolerance.auto_resume_on_failure} resumes from the "
                        f"last complete checkpoint, but save_steps = 0 writes one only at the end",
                        "set save_steps (e.g. 10) for a failure to resume from")]
    return []
