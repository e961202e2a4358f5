"""The rollouts between a source and the trainer loop: those generated ahead of the step that trains
on them, with the weight versions that sampled them.

Depth 0 is synchronous generation: each step's rollout is sampled when the step takes it, by the
newest weights. Depth 1 is `async_generation_ratio: 1`: when a step takes its rollout, the next
step's starts generating with the same weights, and it is collected after this step trains and
before the engine takes the new weights (one step stale). A checkpoint saves the rollouts held.
"""
from __future__ import annotations

import collections
from typing import Any, Deque, Dict, List, Optional

from roll_gspo.distributed.batch import Batch

from pipelines.common import timed
from pipelines.sources import Rollout, RolloutSource


class RolloutBuffer:
    """Rollouts ready for later steps (at most `depth`), and the one being generated."""

    def __init__(self, source: RolloutSource, depth: int, last_step: int):
        if depth not in (0, 1):
            raise ValueError(f"a rollout buffer of depth {depth}: 0 (synchronous) and 1 (one step ahead) are built")
        self.source, self.depth, self.last_step = source, depth, last_step
        self.ready: Deque[Rollout] = collections.deque()
        self.in_flight: Optional[Any] = None  # what source.start_ahead returned

    def take(self, step: int, timings: Dict[str, float]) -> Rollout:
        """`step`'s rollout: the one generated ahead, else one sampled now. Depth 1: the next step's
        starts generating (before this step's weights change)."""
        if self.ready:
            with timed(timings, "generate"):
                rollout = self.ready.popleft()
        else:
            rollout = self.source.produce(step, timings)
        if self.depth and step < self.last_step:
            self.in_flight = self.source.start_ahead(step + 1)
        return rollout

    def fill(self, timings: Dict[str, float]) -> None:
        """Wait for the rollout being generated: it must be complete before the engine takes new weights."""
        if self.in_flight is not None:
            with timed(timings, "generate"):
                self.ready.append(self.source.finish_ahead(self.in_flight))
            self.in_flight = None

    def batches(self) -> List[Batch]:
        """The ready rollouts' batches, oldest first: what a checkpoint saves."""
        return [rollout.batch for rollout in self.ready]

    def restore(self, batches: List[Batch]) -> None:
        """The rollouts a checkpoint saved (`batches`), ready again."""
        self.ready = collections.deque(self.source.restore(batch) for batch in batches)
