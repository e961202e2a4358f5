"""Work held in flight across steps (`async_generation_ratio` k >= 2, the run plan's
`staleness_bound`), seen from the driver.

Two sources keep groups in flight between steps, each in a pool that a step advances: RLVR's
`PooledPromptGroupSource` (every rollout rank's request pool, roll_gspo.strategies.request_pool,
driven over the ranks by `RequestPools`) and the agentic `PooledEpisodeSource` (the driver's
episode pool, roll_gspo.agentic.episode_pool). Both size a pool by one rule (`groups_to_add`) and
log one set of tallies (`PoolTally`); the staleness rule they cut by is
roll_gspo.distributed.staleness's.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

import ray

from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.replaceable import ReplaceableCluster


def groups_to_add(pool_batches: float, quota: int, held: int) -> int:
    """The new groups a pool takes at its next advance: it keeps `pool_batches` (async_pool_batches)
    times its `quota` (its share of a rollout batch) in flight, `held` of them already."""
    return max(0, math.ceil(pool_batches * quota) - held)


def split_over_ranks(total: int, ranks: int) -> List[int]:
    """`total` split over `ranks`, the first ones taking one more."""
    return [total // ranks + (1 if rank < total % ranks else 0) for rank in range(ranks)]


class PoolTally:
    """The groups a pool dropped past the staleness bound since the start (a checkpoint keeps the
    count), and each advance's counts as `rollout/*` metrics."""

    def __init__(self) -> None:
        self.dropped_total = 0

    def metrics(self, partial_groups: int, counts: Mapping[str, int]) -> Dict[str, float]:
        """An advance's metrics: `partial_groups` held after it, and its `counts` (the pools'
        AdvanceCounts / EpisodeCounts as a dict, summed over ranks and rounds) of drops,
        continuations, their re-prefilled tokens and new groups."""
        self.dropped_total += counts["dropped_past_bound"]
        return {"rollout/partial_groups": float(partial_groups),
                "rollout/dropped_past_bound": float(counts["dropped_past_bound"]),
                "rollout/dropped_past_bound_total": float(self.dropped_total),
                "rollout/continuations": float(counts["continuations"]),
                "rollout/reprefill_tokens": float(counts["reprefill_tokens"]),
                "rollout/new_groups": float(counts["new_groups"])}


class RequestPools:
    """The rollout ranks' request pools, advanced together: the groups each rank held after its last
    advance, the ranks that advance called, and (replaceable rollout ranks) each rank's pool as
    that advance left it, for a new process that replaces the rank (the call it then gets again
    continues the same groups)."""

    def __init__(self, staleness_bound: int, gen) -> None:
        self.staleness_bound = staleness_bound
        self.gen = gen  # actor_infer's generating_args
        self.actor_infer: Any = None  # connect()
        self.held: List[int] = []  # per rank
        self.ranks: List[int] = []  # the ranks the last advance called
        self.step = 0  # the step of the last advance
        self.copies: Optional[Dict[int, Any]] = None

    def connect(self, actor_infer) -> None:
        """The rollout ranks; replaceable ones get their pool back when replaced."""
        self.actor_infer = actor_infer
        self.held = self.held or [0] * actor_infer.world_size
        if isinstance(actor_infer, ReplaceableCluster):
            self.copies = {}
            actor_infer.on_replaced.append(self._give_pool)

    def _give_pool(self, rank: int, worker) -> str:
        """A replaced rollout rank's hook: the groups its pool held after its last advance."""
        state = self.copies.get(rank) if self.copies is not None else None
        ray.get(worker.load_pool_state.remote(state))
        return f"its request pool's {len(state['held'])} held groups given back" if state else ""

    def shares(self, total: int) -> List[int]:
        """`total` groups split over the rollout ranks."""
        return split_over_ranks(total, self.actor_infer.world_size)

    def advance(self, step: int, prompts: Batch, new: Sequence[int], quotas: Sequence[int],
                ranks: Sequence[int]) -> list:
        """Advance the pools of `ranks` for `step`: rank r adds its `new[r]` prompts of `prompts`
        (consecutive, by rank) and returns `quotas[r]` complete groups. Returns the calls."""
        starts = [sum(new[:rank]) for rank in range(len(new))]
        self.step, self.ranks = step, list(ranks)
        copy = {"with_state": True} if self.copies is not None else {}
        return [self.actor_infer.call_async(
            rank, "advance", prompts.select(range(starts[rank], starts[rank] + new[rank])), quotas[rank], step,
            self.staleness_bound, gen=self.gen, **copy) for rank in self.ranks]

    def collect(self, calls: list, counts: Dict[str, int]) -> Batch:
        """The advanced ranks' complete groups as one batch; their counts added to `counts`, the
        groups each holds now to `held`."""
        results = self.actor_infer.gather(calls)
        for rank, (_, rank_counts, *state) in zip(self.ranks, results):
            self.held[rank] = rank_counts["partial_groups"]
            for key, value in rank_counts.items():
                counts[key] = counts.get(key, 0) + value
            if self.copies is not None and state:
                self.copies[rank] = state[0]
        return Batch.concat([rows for rows, *_ in results])

    def states(self) -> List[Any]:
        """Every rollout rank's held groups (what a checkpoint saves)."""
        return self.actor_infer.execute_all("pool_state")

    def load_states(self, states: List[Any]) -> None:
        """The rollout ranks' held groups a checkpoint saved, before the first advance."""
        workers = self.actor_infer.workers
        if len(states) != len(workers):
            raise ValueError(f"the checkpoint holds the request pools of {len(states)} rollout ranks, this run has "
                             f"{len(workers)}: resume with the same actor_infer world_size")
        self.actor_infer.gather([self.actor_infer.call_async(rank, "load_pool_state", state)
                                 for rank, state in enumerate(states)])
        self.held = [len(s["held"]) if s else 0 for s in states]
        if self.copies is not None:
            self.copies = dict(enumerate(states))
