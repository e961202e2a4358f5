"""The drift alarm: the trainer-vs-engine log-prob gap watched every step, per task, per turn and per
staleness lag, against two thresholds (warn, stop). Pure: the trainer loop feeds it each step's
per-token gaps and acts on its verdict (docs/algorithm.md#the-drift-alarm).

The gap is |trainer log-prob - rollout engine log-prob| per generated token, measured on the weights
the engine sampled with, before any update. Only tokens sampled by the trainer's current weights
(lag 0) are judged: at lag j >= 1 the gap also holds j updates of the policy itself, which is
learning, not drift; those are logged per lag (`drift/gap/lag<j>`) and never alarm. A group with
fewer than `MIN_TOKENS` tokens is logged, not judged (a handful of tokens is noise).

A breach is one line naming the step, where it started (step, task, turn) and the likely causes,
ordered by what the measurement points at; the line is printed when a breach starts and when it
rises from warn to stop, the `drift/*` metrics every step.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # torch is imported where a gap is computed: the config checks read the thresholds without it
    import torch

MIN_TOKENS = 16  # a judged group's fewest tokens
# The key of a training rank's train_step result holding {row_index: (T,) per-token gaps} (the driver pops it).
TRAINER_GAPS = "response_logprob_gaps"
LEVELS = ("ok", "warn", "stop")

# Likely causes, by name; `likely_causes` orders them for a breach.
CAUSES = {
    "precision": "precision (the engine and the trainer run different bf16/fp16 kernels; the gap grows with the "
                 "model; train_infer_correction weights it, old_logprob_source: trainer keeps the ratio exact)",
    "prefix_cache": "a stale prefix cache (KV computed by earlier weights or another adapter reused after a weight "
                    "sync: later turns drift first)",
    "sampling": "sampling keys the trainer does not follow (actor_infer.generating_args temperature / top_p / top_k, "
                "a logprobs_mode override, kv_cache_dtype / quantization in the engine's strategy_config)",
    "weights": "weights the engine does not hold (a weight sync that did not land, an engine started from another "
               "model or adapter)",
}


@dataclass(frozen=True)
class DriftGroup:
    """Which tokens a gap is over: every judged token (all None), one task's, one turn's, one task's
    turn, or one staleness lag's."""
    task: Optional[str] = None
    turn: Optional[int] = None
    lag: Optional[int] = None

    @property
    def judged(self) -> bool:
        return self.lag is None

    def where(self) -> str:
        """'task arith, turn 2' / 'every task' (the words of the alarm line)."""
        parts = ([f"task {self.task}"] if self.task is not None else []) + (
            [f"turn {self.turn}"] if self.turn is not None else []) + ([f"lag {self.lag}"] if self.lag is not None else [])
        return ", ".join(parts) or "every task"

    def metric_key(self) -> Optional[str]:
        """Its `drift/gap...` metric; None for a task's turn (tasks x turns would flood the tracker)."""
        if self.lag is not None:
            return f"drift/gap/lag{self.lag}"
        if self.task is not None and self.turn is not None:
            return None
        if self.task is not None:
            return f"drift/gap/task/{re.sub(r'[^A-Za-z0-9_.-]+', '_', self.task)}"
        if self.turn is not None:
            return f"drift/gap/turn{self.turn}"
        return "drift/gap"


@dataclass(frozen=True)
class GroupGap:
    """A group's mean gap per token and how many tokens it is over."""
    gap: float
    tokens: int


def gap_matrix(rows: Dict[int, torch.Tensor], mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The training ranks' per-response gaps as (B, T) tensors: the gaps (0 where unmeasured) and the
    measured mask (`mask` (B, T) on the rows the ranks measured). rows: {row: (w,) gaps of its first
    w response positions}."""
    import torch

    gap = torch.zeros(mask.shape, dtype=torch.float32)
    measured = torch.zeros(mask.shape, dtype=torch.float32)
    for row, values in rows.items():
        width = min(int(values.shape[0]), mask.shape[1])
        gap[row, :width] = values[:width].float()
        measured[row] = (mask[row] > 0).float()
    return gap, measured


def group_gaps(gap: torch.Tensor, mask: torch.Tensor, tasks: Sequence[Optional[str]],
               turn_index: Optional[torch.Tensor] = None,
               lags: Optional[torch.Tensor] = None) -> Dict[DriftGroup, GroupGap]:
    """Mean |trainer - engine| per token of each group.

    gap: (B, T) per-token gaps (any value where mask is 0); mask: (B, T), 1 on the measured
    generated tokens; tasks: B task names (None: unnamed); turn_index: (B, T) long, each token's turn
    (agentic; negative: none); lags: (B, T), trainer version - the version that sampled the token
    (None: every token lag 0). Judged groups (every task, each task, each turn, each task's turn)
    are over lag-0 tokens; each lag's group over its own tokens. Groups without tokens are absent.
    """
    import torch

    mask = mask.to(torch.float64) * (torch.nan_to_num(gap) == gap).to(torch.float64)
    gap = torch.nan_to_num(gap.to(torch.float64)).abs()
    lags = torch.zeros_like(mask) if lags is None else lags.to(torch.float64).round()
    out: Dict[DriftGroup, GroupGap] = {}

    def add(group: DriftGroup, where: torch.Tensor) -> None:
        count = float(where.sum())
        if count > 0:
            out[group] = GroupGap(float((gap * where).sum()) / count, int(round(count)))

    current = mask * (lags == 0)
    add(DriftGroup(), current)
    names = sorted({t for t in tasks if t is not None})
    turns = sorted({int(t) for t in turn_index[mask.bool()].tolist() if int(t) >= 0}) if turn_index is not None else []
    for name in names:
        own = current * torch.tensor([[1.0] if t == name else [0.0] for t in tasks], dtype=torch.float64)
        add(DriftGroup(task=name), own)
        if turn_index is not None:
            for turn in turns:
                add(DriftGroup(task=name, turn=turn), own * (turn_index == turn))
    for turn in turns:
        add(DriftGroup(turn=turn), current * (turn_index == turn))
    measured_lags = sorted({int(v) for v in lags[mask.bool()].tolist()})
    if measured_lags != [0]:  # per lag only where tokens of other versions were measured
        for lag in measured_lags:
            add(DriftGroup(lag=lag), mask * (lags == lag))
    return out


@dataclass(frozen=True)
class DriftThresholds:
    """The gaps (mean per token) that warn and stop, and what they were chosen for (the words of the line)."""
    warn: float
    stop: float
    basis: str  # e.g. "fp32 on both sides (auto)"
    exact_precision: bool  # fp32 on both sides: no kernel drift expected


@dataclass(frozen=True)
class DriftVerdict:
    """One step's verdict: its level, the worst judged group, and where the breach started."""
    step: int
    level: str  # "ok" | "warn" | "stop"
    group: DriftGroup
    gap: float
    threshold: float
    started: Tuple[int, DriftGroup]  # (step, group) of the breach's first step
    causes: Tuple[str, ...]
    thresholds: DriftThresholds

    def line(self) -> str:
        start_step, start_group = self.started
        began = ("" if start_step == self.step else
                 f"; it started at step {start_step} ({start_group.where()})")
        stops = " The run stops after this step's checkpoint policy." if self.level == "stop" else ""
        return (f"drift alarm ({self.level}): step {self.step}, {self.group.where()}: trainer-vs-engine log-prob gap "
                f"{self.gap:.3g} per token > {self.level}_gap {self.threshold:.3g} ({self.thresholds.basis}){began}. "
                f"Likely causes: {'; '.join(CAUSES[c] for c in self.causes)}.{stops}")


def likely_causes(worst: DriftGroup, gaps: Dict[DriftGroup, GroupGap], exact_precision: bool) -> Tuple[str, ...]:
    """CAUSES' names, the most likely first: precision where the run is not fp32 on both sides; a
    stale prefix cache where a later turn drifts more than the first; then sampling keys and weights."""
    first_turn = min((g.turn for g in gaps if g.turn is not None and g.task is None), default=None)
    later_turn_worse = (worst.turn is not None and first_turn is not None and worst.turn > first_turn
                        and gaps[worst].gap > 2 * gaps[DriftGroup(task=worst.task, turn=first_turn)].gap
                        if DriftGroup(task=worst.task, turn=first_turn) in gaps else False)
    order: List[str] = []
    if later_turn_worse:
        order.append("prefix_cache")
    if not exact_precision:
        order.append("precision")
    order += [c for c in ("sampling", "weights", "prefix_cache") if c not in order]
    return tuple(order)


class DriftAlarm:
    """Fed each step's group gaps (`group_gaps`); `observe` returns the step's verdict (None when
    nothing was measured) and `metrics` its `drift/*` figures."""

    def __init__(self, thresholds: DriftThresholds, min_tokens: int = MIN_TOKENS):
        if not 0 < thresholds.warn <= thresholds.stop:
            raise ValueError(f"drift thresholds need 0 < warn <= stop, got warn {thresholds.warn}, "
                             f"stop {thresholds.stop}")
        self.thresholds = thresholds
        self.min_tokens = min_tokens
        self.started: Optional[Tuple[int, DriftGroup]] = None  # the current breach's first step and group
        self.breaches = 0  # steps that breached so far

    def observe(self, step: int, gaps: Dict[DriftGroup, GroupGap]) -> Optional[DriftVerdict]:
        judged = {g: v for g, v in gaps.items() if g.judged and v.tokens >= self.min_tokens}
        if not judged:
            return None
        worst = max(judged, key=lambda g: (judged[g].gap, g.task is not None, g.turn is not None))
        gap = judged[worst].gap
        level = "stop" if gap > self.thresholds.stop else "warn" if gap > self.thresholds.warn else "ok"
        if level == "ok":
            self.started = None
        else:
            self.breaches += 1
            if self.started is None:
                self.started = (step, worst)
        threshold = self.thresholds.stop if level == "stop" else self.thresholds.warn
        return DriftVerdict(step, level, worst, gap, threshold, self.started or (step, worst),
                            likely_causes(worst, gaps, self.thresholds.exact_precision), self.thresholds)

    def metrics(self, gaps: Dict[DriftGroup, GroupGap], verdict: Optional[DriftVerdict]) -> Dict[str, float]:
        """`drift/gap` (judged tokens), `drift/gap/task/<task>`, `drift/gap/turn<n>`, `drift/gap/lag<j>`,
        `drift/level` (0 ok, 1 warn, 2 stop), `drift/breaches` (steps so far)."""
        out = {key: v.gap for g, v in gaps.items() if (key := g.metric_key()) is not None and math.isfinite(v.gap)}
        if verdict is not None:
            out["drift/level"] = float(LEVELS.index(verdict.level))
        out["drift/breaches"] = float(self.breaches)
        return out


def announce(verdict: Optional[DriftVerdict], previous: Optional[DriftVerdict]) -> bool:
    """Whether `verdict` gets its line: a breach that starts, or one that rises from warn to stop."""
    if verdict is None or verdict.level == "ok":
        return False
    before = "ok" if previous is None else previous.level
    return LEVELS.index(verdict.level) > LEVELS.index(before)
