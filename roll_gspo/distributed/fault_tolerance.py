"""Replacing ranks that die or hang (`fault_tolerance`): the feature's rules, pure Python (no Ray).

* Which roles are replaceable: rollout ranks (`replaceable_rollout`: the RLVR pipeline's, and the
  agentic pipeline's with synchronous generation) and reward workers. Their ranks are independent
  of each other and hold nothing the run cannot give a new process again: the trainer's weights,
  the prompts of the calls they held (with the same per-request seeds), the request pool's held
  groups (the driver's copy after the rank's last advance). An agentic episode's state (its env,
  its context) lives in the driver; a rank holds only its turns in flight, each one call, sent
  again with its seed. Training, reference and critic ranks hold optimizer state and take part in collectives:
  they are not replaced mid-step; the run stops with its last complete checkpoint, and
  `auto_resume_on_failure` resumes from it (`auto_resume_checkpoint`).
* How often: `RestartBudget`, `max_restarts` per rank and run; one death more stops the run.
* What counts as hung (`HangWatch`): a rank that does not answer a health probe within
  `hang_timeout_s`, or holds requests while its engine takes no step for that long. A slow engine
  takes steps; a hung one does not, or does not answer at all.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from roll_gspo.schema.config import PipelineConfig

METRIC_PREFIX = "fault/restarts/"


def replaceable_rollout(cfg: PipelineConfig) -> bool:
    """Rollout ranks are replaced when they die or hang, with `max_restarts` > 0: the RLVR
    pipeline's, and the agentic pipeline's with `async_generation_ratio: 0` (its turns are played
    by the driver's main thread while the trainer waits; generating ahead, k >= 1, plays them in a
    thread while the trainer trains, where a replacement's weight hand-over would run beside the
    training calls). Not behind the rollout endpoint (outside clients, an agent's episodes among
    them, hold requests on the ranks)."""
    if cfg.rollout_endpoint.enabled or cfg.fault_tolerance.max_restarts <= 0:
        return False
    return cfg.pipeline == "rlvr" or (cfg.pipeline == "agentic" and not cfg.async_generation_ratio)


def probe_interval_s(hang_timeout_s: float) -> float:
    """How often a waiting driver probes a rank: a quarter of the deadline, at most every 10 s."""
    return max(0.05, min(10.0, hang_timeout_s / 4))


class RestartBudget:
    """Replacements per (role, rank) over a run, at most `max_restarts` each, and those made since
    the metrics last read them (`fault/restarts/<role>`)."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.used: Dict[Tuple[str, int], int] = {}
        self.unreported: Dict[str, int] = {}

    def allows(self, role: str, rank: int) -> bool:
        """Whether `rank` of `role` may be replaced once more."""
        return self.used.get((role, rank), 0) < self.max_restarts

    def record(self, role: str, rank: int) -> int:
        """A replacement made; returns how many `rank` of `role` has had, this one included."""
        count = self.used[(role, rank)] = self.used.get((role, rank), 0) + 1
        self.unreported[role] = self.unreported.get(role, 0) + 1
        return count

    def metrics(self, roles: Sequence[str]) -> Dict[str, float]:
        """`fault/restarts/<role>`: the replacements since the last call, for each of `roles` (0 too)."""
        out = {f"{METRIC_PREFIX}{role}": float(self.unreported.pop(role, 0)) for role in roles}
        return out

    def exhausted_sentence(self, role: str, rank: int) -> str:
        used = self.used.get((role, rank), 0)
        if self.max_restarts == 0:
            return "Replacing rollout ranks is off (fault_tolerance.max_restarts = 0)"
        return (f"It was replaced {used} time{'s' if used != 1 else ''} already in this run "
                f"(fault_tolerance.max_restarts = {self.max_restarts})")


@dataclasses.dataclass
class HangWatch:
    """One rank's health while the driver waits for it. `probe_sent(t)` when a probe goes out,
    `answered(t, steps, in_flight)` when it comes back (the engine's step counter, the requests it
    holds), `verdict(t)`: why the rank is hung, or None."""

    timeout_s: float
    started: float  # when the driver began to wait for the rank
    probe_at: Optional[float] = None  # an unanswered probe's send time
    steps: Optional[int] = None
    in_flight: int = 0
    progress_at: Optional[float] = None  # the last time the engine was seen stepping (or idle)

    def probe_sent(self, now: float) -> None:
        if self.probe_at is None:
            self.probe_at = now

    def answered(self, now: float, steps: int, in_flight: int) -> None:
        if self.steps is None or steps != self.steps or not in_flight:
            self.progress_at = now
        self.steps, self.in_flight, self.probe_at = steps, in_flight, None

    def verdict(self, now: float) -> Optional[str]:
        if self.probe_at is not None and now - self.probe_at > self.timeout_s:
            return f"did not answer a health probe within fault_tolerance.hang_timeout_s = {self.timeout_s:g} s"
        if self.in_flight and self.progress_at is not None and now - self.progress_at > self.timeout_s:
            return (f"held {self.in_flight} requests while its engine took no step for "
                    f"fault_tolerance.hang_timeout_s = {self.timeout_s:g} s")
        return None


def regeneration_note(version: int, peers_version: int, exact: bool) -> str:
    """What a replaced rollout rank was given, for its console line."""
    if exact:
        return f"weights of step {version}"
    return (f"the trainer's weights of step {version} (its peers sample with step {peers_version}'s: the "
            f"prompts it held are sampled again with newer weights, not bit-identical to an uninterrupted run)")


def auto_resume_checkpoint(resumable: bool, used: int, limit: int, checkpoints: List[str]) -> Optional[str]:
    """The checkpoint `auto_resume_on_failure` resumes from after a failure, or None (the run stops):
    only after a rank death that replacement does not cover (`resumable`), at most `limit` times,
    and only from a complete checkpoint."""
    if not resumable or used >= limit or not checkpoints:
        return None
    return checkpoints[-1]


# The phase each rank call belongs to, for the one line that reports a rank hung in it.
PHASE_OF_CALL = {"generate": "generate", "advance": "generate", "generate_turns": "generate",
                 "compute_scores": "reward", "compute_log_probs": "log-probs", "compute_values": "log-probs",
                 "train_step": "train", "sync_weights_to": "weight sync", "load_weight_bucket": "weight sync",
                 "save_checkpoint": "checkpoint write", "load_checkpoint": "checkpoint load", "setup": "setup"}
UNBOUNDED_CALLS = frozenset({"setup"})  # a rank's actor may still be starting: Ray's placement timeout bounds it


def phase_of(call: str) -> str:
    """`train (train_step)` for a rank's method name; the name alone when it is no known phase."""
    phase = PHASE_OF_CALL.get(call)
    return f"{phase} ({call})" if phase and phase != call else call


class PhaseDeadline:
    """How long the driver waits on a call to ranks that cannot be replaced (training, reference,
    critic) before a rank that does not answer a health probe is hung: max(`floor_s`, `factor` x
    the median of the same call's earlier durations in this run), `first_s` for a call not timed
    yet; none for `UNBOUNDED_CALLS`. A rank that answers is waiting or working, never hung."""

    KEEP = 50  # durations kept per call

    def __init__(self, factor: float, floor_s: float, first_s: float):
        self.factor, self.floor_s, self.first_s = factor, floor_s, first_s
        self.durations: Dict[str, List[float]] = {}

    def record(self, call: str, seconds: float) -> None:
        kept = self.durations.setdefault(call, [])
        kept.append(seconds)
        del kept[:-self.KEEP]

    def bound(self, call: str) -> Optional[Tuple[float, str]]:
        """(seconds, how they were derived) for `call`, None when it is not bounded."""
        if call in UNBOUNDED_CALLS:
            return None
        earlier = self.durations.get(call, [])
        if not earlier:
            return self.first_s, (f"{self.first_s:g} s (max of fault_tolerance.phase_timeout_floor_s and "
                                  f"hang_timeout_s: no earlier {call} to time)")
        median = statistics.median(earlier)
        seconds = max(self.floor_s, self.factor * median)
        return seconds, (f"{seconds:.3g} s = max(fault_tolerance.phase_timeout_floor_s = {self.floor_s:g}, "
                         f"phase_timeout_factor = {self.factor:g} x the median {call} of this run, {median:.3g} s)")


def hung_message(who: str, call: str, waited_s: float, silent_s: float, how: str, answering: Sequence[str]) -> str:
    """The first part of the line that reports a rank stopped or hung (the cluster adds its output
    file and the resume command)."""
    peers = (f"; {', '.join(answering)} answer{'s' if len(answering) == 1 else ''} (waiting for it)"
             if answering else "")
    return (f"{who} is unresponsive (stopped or hung, not dead): it did not answer a health probe for "
            f"{silent_s:.0f} s while its role ran {phase_of(call)} for {waited_s:.0f} s; the bound: {how}{peers}")


COLLECTIVE_TIMEOUT_ENV = "ROLL_GSPO_COLLECTIVE_TIMEOUT_S"


def collective_timeout():
    """The training ranks' process-group timeout (`fault_tolerance.collective_timeout_s`, passed in
    the ranks' environment), a timedelta; torch's default (30 min) where it is not set."""
    import datetime
    import os

    seconds = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    return datetime.timedelta(seconds=float(seconds) if seconds else 1800.0)
