"""Stalls: a step phase far above its own usual time, throughput collapsing, the trainer idle most of
a step. One rule, used live (`StallWatch`: a console line and `stall/*` metrics as the run goes) and
afterwards (`find_stalls` over metrics.jsonl: the run report's marks).

A phase stalls when it takes more than `FACTOR` times its median over the steps before and at least
`MIN_EXCESS_S` more (a 0.1 s phase taking 0.4 s is noise, not a stall), once `WARMUP` steps have set
the median. Which role runs each phase is named, so the line says where to look.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

FACTOR = 3.0
MIN_EXCESS_S = 1.0
WARMUP = 3  # steps of a phase before its median means anything
THROUGHPUT_COLLAPSE = 1 / 3  # tokens per second below a third of the median
IDLE_SHARE = 0.8  # the trainer's phases under a fifth of the step, and under a third of their usual share

# The role (or the driver) whose work each `time/<phase>_s` is.
PHASE_ROLES = {
    "generate": "actor_infer", "offload": "actor_infer", "validation": "actor_infer", "reward": "rewards",
    "reference": "reference", "old_log_probs": "actor_train", "train": "actor_train", "sync": "actor_train -> actor_infer",
    "values": "critic", "advantages": "driver", "record": "driver", "wait": "actor_infer",
}
TRAINER_PHASES = ("reference", "old_log_probs", "train", "values")
THROUGHPUT_KEY = "throughput/tokens_per_s"


@dataclass(frozen=True)
class Stall:
    step: int
    kind: str  # "phase" | "throughput" | "idle"
    phase: str  # the phase (or `step` for throughput and idle)
    seconds: float  # the phase's time (throughput: tokens/s; idle: the trainer's share of the step)
    median: float

    @property
    def role(self) -> str:
        return PHASE_ROLES.get(self.phase, "driver")

    def line(self) -> str:
        if self.kind == "phase":
            return (f"stall: step {self.step} {self.phase} ({self.role}) took {self.seconds:.1f} s, "
                    f"{self.seconds / max(self.median, 1e-9):.1f}x its median {self.median:.1f} s")
        if self.kind == "throughput":
            return (f"stall: step {self.step} throughput {self.seconds:.0f} tokens/s, under a third of its "
                    f"median {self.median:.0f}")
        return (f"stall: step {self.step} the trainer (actor_train) worked {100 * self.seconds:.0f} % of the "
                f"step, against {100 * self.median:.0f} % usually; it waited on the rest")


def phase_times(row: Dict[str, Optional[float]]) -> Dict[str, float]:
    """`time/<phase>_s` of a metrics row, by phase (not the step total)."""
    return {key[len("time/"):-len("_s")]: float(value) for key, value in row.items()
            if key.startswith("time/") and key.endswith("_s") and key != "time/step_s" and value is not None}


def is_stall(seconds: float, history: Sequence[float]) -> bool:
    """The rule: over FACTOR x the median of `history` and MIN_EXCESS_S above it, after WARMUP values."""
    if len(history) < WARMUP:
        return False
    median = statistics.median(history)
    return seconds > FACTOR * median and seconds - median >= MIN_EXCESS_S


class StallWatch:
    """Follows each step's metrics; `observe` returns the stalls of this step (a phase over its
    median, throughput collapsing, the trainer idle most of the step)."""

    def __init__(self) -> None:
        self.history: Dict[str, List[float]] = {}
        self.total = 0

    def observe(self, step: int, row: Dict[str, Optional[float]]) -> List[Stall]:
        stalls = []
        for phase, seconds in phase_times(row).items():
            past = self.history.setdefault(phase, [])
            if is_stall(seconds, past):
                stalls.append(Stall(step, "phase", phase, seconds, statistics.median(past)))
            past.append(seconds)
        rate = row.get(THROUGHPUT_KEY)
        if rate is not None:
            past = self.history.setdefault(THROUGHPUT_KEY, [])
            if len(past) >= WARMUP and rate < THROUGHPUT_COLLAPSE * statistics.median(past):
                stalls.append(Stall(step, "throughput", "step", float(rate), statistics.median(past)))
            past.append(float(rate))
        share = _trainer_share(row)
        if share is not None:
            past = self.history.setdefault("trainer_share", [])
            slow_phase = any(s.kind == "phase" for s in stalls)  # that line says where the time went already
            if (not slow_phase and len(past) >= WARMUP and share < 1 - IDLE_SHARE
                    and share < THROUGHPUT_COLLAPSE * statistics.median(past)):
                stalls.append(Stall(step, "idle", "step", share, statistics.median(past)))
            past.append(share)
        self.total += len(stalls)
        return stalls

    def metrics(self, stalls: Sequence[Stall]) -> Dict[str, float]:
        """`stall/count` (this step), `stall/total` (the run), `stall/<phase>` for each phase that stalled."""
        out = {"stall/count": float(len(stalls)), "stall/total": float(self.total)}
        out.update({f"stall/{s.phase if s.kind == 'phase' else s.kind}": 1.0 for s in stalls})
        return out


def _trainer_share(row: Dict[str, Optional[float]]) -> Optional[float]:
    """The trainer's phases as a share of a step long enough to matter (None: no such step). A step
    where generation dominates by design (a small CPU machine) has a low share every step; only a
    drop against its own usual share is a stall."""
    total = row.get("time/step_s")
    phases = phase_times(row)
    if not total or total < MIN_EXCESS_S * 2 or "train" not in phases:
        return None
    return sum(phases.get(p, 0.0) for p in TRAINER_PHASES) / total


def find_stalls(rows: Sequence[Dict[str, Optional[float]]]) -> List[Stall]:
    """Every stall of a run's metrics rows (metrics.jsonl), as the live watch would have flagged them."""
    watch = StallWatch()
    found: List[Stall] = []
    for row in rows:
        if "step" in row and row["step"]:
            found += watch.observe(int(row["step"]), row)
    return found
