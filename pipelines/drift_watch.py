"""The drift alarm in a run: each step's per-token trainer-vs-engine gaps (the training ranks measure
them on their first mini-batch, before any update) grouped by the batch's tasks, turns and staleness
lags, judged by `roll_gspo.metrics.drift.DriftAlarm` against the plan's thresholds; one console line
per breach, `drift/*` metrics every step, and a stop after the step's checkpoint policy
(docs/algorithm.md#the-drift-alarm)."""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional

import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.lifecycle.checkpoint import complete_checkpoints
from roll_gspo.metrics.drift import (DriftAlarm, DriftThresholds, DriftVerdict, announce, gap_matrix,
                                     group_gaps)

logger = logging.getLogger("roll_gspo")


class DriftStop(ValueError):
    """The drift alarm's stop gap was crossed: the run ends with this line (a value out of its allowed
    range, so `run_pipeline.py` prints it as one line and exits 1)."""


def row_tasks(batch: Batch) -> List[Optional[str]]:
    """Each row's task: its data domain (RLVR) or its episode's tag (agentic); None when unnamed."""
    if "domain" in batch.meta:
        return [None if d is None else str(d) for d in batch.meta["domain"]]
    if "episode" in batch.meta:
        return [None if e.get("tag") is None else str(e.get("tag")) for e in batch.meta["episode"]]
    return [None] * len(batch)


def token_lags(batch: Batch, trainer_version: int) -> torch.Tensor:
    """(B, T) trainer version - the version that sampled each token: the loop's `token_lags` (k >= 2),
    else each row's weight version for all its tokens (0 everywhere without one)."""
    width = batch["response_mask"].shape[1]
    if "token_lags" in batch:
        return batch["token_lags"]
    if "weight_version" not in batch:
        return torch.zeros(len(batch), width)
    rows = torch.tensor([float(trainer_version - int(v)) for v in batch["weight_version"]])
    return rows[:, None].expand(len(batch), width)


class DriftWatch:
    """The run's alarm (None thresholds: off); `observe` each trained step, `stop_if_breached` after
    its checkpoint policy."""

    def __init__(self, thresholds: Optional[DriftThresholds], checkpoint_dir: str):
        self.alarm = DriftAlarm(thresholds) if thresholds is not None else None
        self.checkpoint_dir = checkpoint_dir  # the run's checkpoint_base: where its checkpoints are
        self.last: Optional[DriftVerdict] = None

    def observe(self, step: int, batch: Batch, trainer_gaps: Dict[int, torch.Tensor]) -> Dict[str, float]:
        """The step's `drift/*` metrics; a breach that starts or rises is logged as one line."""
        if self.alarm is None or not trainer_gaps:
            return {}
        mask = batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]
        gap, measured = gap_matrix(trainer_gaps, mask)
        turns = batch["turn_index"] if "turn_index" in batch else None
        gaps = group_gaps(gap, measured, row_tasks(batch), turns, token_lags(batch, step - 1))
        verdict = self.alarm.observe(step, gaps)
        if announce(verdict, self.last):
            logger.warning(verdict.line())  # type: ignore[union-attr]  # announce: not None
        self.last = verdict
        return self.alarm.metrics(gaps, verdict)

    def stop_if_breached(self, step: int, before_stop: Callable[[], None]) -> None:
        """Raise `DriftStop` when this step crossed the stop gap, `before_stop` run first (the run
        report); called after the step's checkpoint policy ran, which it does not change."""
        verdict = self.last
        if verdict is None or verdict.step != step or verdict.level != "stop":
            return
        before_stop()
        folders = complete_checkpoints(self.checkpoint_dir)
        kept = (f"the last complete checkpoint is {folders[-1]} (resume with resume_from_checkpoint=auto once the "
                f"cause is fixed)" if folders else "no checkpoint was written (save_steps)")
        raise DriftStop(f"the drift alarm stopped the run at step {verdict.step}: {verdict.group.where()} had a "
                        f"trainer-vs-engine log-prob gap of {verdict.gap:.3g} per token, above stop_gap "
                        f"{verdict.threshold:.3g} ({verdict.thresholds.basis}); {kept}")
