"""The rollouts between a source and the trainer loop: those generated ahead of the step that trains
on them, with the weight versions that sampled them.

The run plan decides the depth (`RunPlan.rollout_depth`). Depth 0 is synchronous generation: each
step's rollout is sampled when the step takes it, by the newest weights. Depth d >= 1 keeps d
rollouts ahead: when a step takes its rollout, the rollouts of the steps up to step + d that are
neither ready nor being generated start, with the same weights, and all of them are collected
after this step trains and before the engine takes the new weights; a rollout is thus trained at
most d steps after the weights that sampled it. `async_generation_ratio` 1 and k >= 2 are depth 1
(k >= 2 then bounds the staleness of partial rollouts inside the source's pools, docs/async.md). A
checkpoint saves the rollouts held ready.
"""
from __future__ import annotations

import collections
from typing import Any, Deque, Dict, List

from roll_gspo.distributed.batch import Batch

from pipelines.common import timed
from pipelines.sources import Rollout, RolloutSource


class RolloutBuffer:
    """Rollouts ready for later steps, and those being generated: `depth` of them at most."""

    def __init__(self, source: RolloutSource, depth: int, last_step: int):
        if depth < 0:
            raise ValueError(f"a rollout buffer of depth {depth}: 0 (synchronous) or the rollouts kept ahead")
        self.source, self.depth, self.last_step = source, depth, last_step
        self.ready: Deque[Rollout] = collections.deque()
        self.in_flight: Deque[Any] = collections.deque()  # what source.start_ahead returned, oldest first

    def take(self, step: int, timings: Dict[str, float]) -> Rollout:
        """`step`'s rollout: the one generated ahead, else one sampled now. Then the rollouts of the
        steps up to step + depth (not past the last) that are not held yet start generating, before
        this step's weights change."""
        if self.ready:
            with timed(timings, "generate"):
                rollout = self.ready.popleft()
        else:
            rollout = self.source.produce(step, timings)
        first = step + 1 + len(self.ready) + len(self.in_flight)  # the first step nothing is held for
        for ahead in range(first, min(step + self.depth, self.last_step) + 1):
            self.in_flight.append(self.source.start_ahead(ahead))
        return rollout

    def fill(self, timings: Dict[str, float]) -> None:
        """Wait for the rollouts being generated: they must be complete before the engine takes new weights."""
        if self.in_flight:
            with timed(timings, "generate"):
                while self.in_flight:
                    self.ready.append(self.source.finish_ahead(self.in_flight.popleft()))

    def batches(self) -> List[Batch]:
        """The ready rollouts' batches, oldest first: what a checkpoint saves."""
        return [rollout.batch for rollout in self.ready]

    def restore(self, batches: List[Batch]) -> None:
        """The rollouts a checkpoint saved (`batches`), ready again."""
        self.ready = collections.deque(self.source.restore(batch) for batch in batches)
