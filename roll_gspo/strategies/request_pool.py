"""The prompt groups a rollout rank keeps in flight across weight updates (`async_generation_ratio`
k >= 2): partial rollouts continued by re-prefill, streaming of complete groups, the staleness
bound. Pure Python over the `RolloutEngine` contract (roll_gspo.strategies.engine); no Ray.

`RequestPool.advance(prompts, quota, step, bound, sampling, n)`:

1. every held partial request is resubmitted as a continuation: the prompt ids plus its tokens so
   far as the new prompt, its cap reduced by what it has, and a seed derived from its first seed
   and its segment number (`continuation_seed`: a new segment never replays the first one's
   random numbers); then the new prompt groups, n requests each (seed sample_seed + j);
2. the engine is stepped until `quota` groups have all n responses finished (a group finishes
   with its last response; groups finishing on one engine step count in submission order) and
   what the staleness bound needs has finished too (`bound_demands`): every held group at its
   last chance (incomplete at this cut, it would be past the bound), however many, and for each
   later advance j enough of the groups due by then that at most j * `quota` of them are left
   (each advance takes `quota`, the oldest first). A long response thus gets k advances and is
   then waited for, never dropped for its length (dropping would train the short responses
   only); with at most k * `quota` groups in the pool (`async_pool_batches` <= k) none is dropped;
3. the cut: every request still in flight is aborted (the engine returns its tokens, log-probs and
   per-token weight versions) and held; held groups whose oldest token can no longer be trained
   within the bound are dropped: they would be trained at step + 1 or later, by a trainer holding
   version step or later, so a group whose oldest token has version v with step - v > bound goes;
4. `quota` complete groups come back, the oldest first (by their oldest token's version, then
   submission order), with the counts of the call.

Because every request is aborted at the cut, the engine holds nothing between two calls: a weight
sync, validation, `score` or an adapter load find it empty, the prefix cache reset applies to all,
and every token sampled after an update is computed from a prefill under the new weights (no KV
cache of the old weights), so each token's log-prob is exactly its own version's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from roll_gspo.distributed.staleness import deadline_demands
from roll_gspo.strategies.engine import RequestOutput, RolloutEngine, Sampling

# SeedSequence's stream of continuation seeds (rollout seeds use the stream ids of
# roll_gspo.lifecycle.seeding; this entropy word keeps continuations apart from them).
_CONTINUATION_STREAM = 0x5EC7


def continuation_seed(seed: Optional[int], segment: int) -> Optional[int]:
    """The seed of a request's `segment`-th submission (0: its own seed; None stays None, unseeded)."""
    if seed is None or segment == 0:
        return seed
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, _CONTINUATION_STREAM, int(segment)])
    return int(state.generate_state(1, dtype=np.uint32)[0]) >> 1


@dataclasses.dataclass
class PoolRequest:
    """One response of a held group: its tokens so far (each with its log-prob and the weight
    version that sampled it), how many times it was submitted, and why it ended (None: partial)."""

    seed: Optional[int]
    submitted_version: int
    token_ids: List[int] = dataclasses.field(default_factory=list)
    log_probs: List[float] = dataclasses.field(default_factory=list)
    weight_versions: List[int] = dataclasses.field(default_factory=list)
    segments: int = 0
    finish_reason: Optional[str] = None  # "stop" / "length" once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def weight_version(self) -> int:
        """The oldest version among its tokens (the version at submit without tokens)."""
        return min(self.weight_versions, default=self.submitted_version)

    def add(self, out: RequestOutput) -> None:
        """What a segment returned (finished, or cut by the abort)."""
        self.token_ids.extend(out.token_ids)
        self.log_probs.extend(out.log_probs)
        self.weight_versions.extend(out.weight_versions)
        self.segments += 1
        if out.finish_reason in ("stop", "length"):
            self.finish_reason = out.finish_reason


@dataclasses.dataclass
class PoolGroup:
    """A prompt's n responses; `meta`: the prompt's row (prompt_ids, sample_seed, ground truth, ...)."""

    key: str
    meta: Dict[str, Any]
    requests: List[PoolRequest]

    @property
    def prompt_ids(self) -> List[int]:
        return list(self.meta["prompt_ids"])

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.requests)

    def oldest_version(self) -> Optional[int]:
        """The oldest weight version among the group's tokens; None before it has any."""
        versions = [min(r.weight_versions) for r in self.requests if r.weight_versions]
        return min(versions) if versions else None


@dataclasses.dataclass
class AdvanceCounts:
    """What one `advance` did."""

    complete: int = 0  # groups returned
    partial_groups: int = 0  # groups held after the cut (partial, or complete beyond the quota)
    dropped_past_bound: int = 0  # held groups dropped: their oldest token would be trained past the bound
    continuations: int = 0  # partial requests resubmitted
    reprefill_tokens: int = 0  # response tokens those continuations prefilled again
    new_groups: int = 0  # prompt groups submitted for the first time

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


class RequestPool:
    """A rollout rank's prompt groups in flight across `advance` calls (see the module)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.held: List[PoolGroup] = []
        self.added = 0  # groups ever added: their keys (and request ids) are unique per pool

    def advance(self, prompts: Sequence[Dict[str, Any]], quota: int, step: int, bound: int, sampling: Sampling,
                n: int) -> Tuple[List[PoolGroup], AdvanceCounts]:
        """Continue the held groups, add `prompts` (rows with prompt_ids and sample_seed) as new
        groups of `n`, step until `quota` groups are complete, cut; returns those groups (complete
        held ones first, then in the order they finished) and the counts."""
        if self.engine.unfinished():
            raise RuntimeError(f"a request pool advances an idle engine; it has {len(self.engine.unfinished())} "
                               f"requests in flight")
        counts = AdvanceCounts()
        for row in prompts:
            seed = row.get("sample_seed")
            self.held.append(PoolGroup(f"p{self.added}", dict(row), [
                PoolRequest(None if seed is None else int(seed) + j, self.engine.weight_version) for j in range(n)]))
            self.added += 1
            counts.new_groups += 1
        groups = self.held
        if quota > len(groups):
            raise ValueError(f"a quota of {quota} complete groups from a pool of {len(groups)}")
        order = {group.key: index for index, group in enumerate(groups)}
        owner: Dict[str, Tuple[PoolGroup, PoolRequest]] = {}
        waiting: Dict[str, int] = {}
        for group in groups:
            for j, request in enumerate(group.requests):
                if request.finished:
                    continue
                request_id = f"{group.key}/{j}/{request.segments}"
                prompt = group.prompt_ids + request.token_ids
                cap = sampling.max_new_tokens
                if request.token_ids:
                    counts.continuations += 1
                    counts.reprefill_tokens += len(request.token_ids)
                # One hf_infer batch row per continuation (its own prompt); new groups batch together.
                self.engine.submit(request_id, prompt, dataclasses.replace(
                    sampling, max_new_tokens=None if cap is None else cap - len(request.token_ids)),
                    continuation_seed(request.seed, request.segments),
                    group=group.key if not request.segments else request_id)
                owner[request_id] = (group, request)
                waiting[group.key] = waiting.get(group.key, 0) + 1
        complete = [group for group in groups if group.complete]  # finished before (beyond an earlier quota)
        demands = bound_demands(groups, step, bound, quota)
        while not _cut_reached(complete, quota, demands):
            if not self.engine.unfinished():
                raise RuntimeError(f"the engine ran out of requests with {len(complete)} of {quota} groups complete")
            finished_now = []
            for request_id in self.engine.step():
                if request_id in owner:
                    group = owner[request_id][0]
                    waiting[group.key] -= 1
                    if not waiting[group.key]:
                        finished_now.append(group)
            complete.extend(sorted(finished_now, key=lambda g: order[g.key]))
        # The cut: everything comes back, finished or aborted with its tokens so far.
        for out in self.engine.abort(list(owner)):
            owner[out.request_id][1].add(out)
        # Oldest first (then submission order): the groups nearest the bound are trained now.
        complete.sort(key=lambda g: (_oldest_or_new(g), order[g.key]))
        taken = complete[:quota]
        taken_keys = {group.key for group in taken}
        kept = []
        for group in groups:
            if group.key in taken_keys:
                continue
            if _past(group, step, bound):
                counts.dropped_past_bound += 1
            else:
                kept.append(group)
        self.held = kept
        counts.complete, counts.partial_groups = len(taken), len(kept)
        return taken, counts

    # -- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """The held groups as plain lists and dicts (what a checkpoint saves)."""
        return {"added": self.added, "held": [{"key": g.key, "meta": g.meta,
                                               "requests": [dataclasses.asdict(r) for r in g.requests]}
                                              for g in self.held]}

    def load_state(self, state: Dict[str, Any]) -> None:
        """Back to the groups `state()` returned (the engine must be idle)."""
        self.added = int(state["added"])
        self.held = [PoolGroup(g["key"], dict(g["meta"]), [PoolRequest(**r) for r in g["requests"]])
                     for g in state["held"]]


def bound_demands(groups: Sequence[PoolGroup], step: int, bound: int, quota: int) -> List[Tuple[Set[str], int]]:
    """What the cut of `step` waits for so that the bound drops no group for its length: pairs
    (keys, m), at least m of the groups `keys` complete (the rule:
    roll_gspo.distributed.staleness.deadline_demands)."""
    return deadline_demands({group.key: group.oldest_version() for group in groups}, step, bound, quota)


def _cut_reached(complete: List[PoolGroup], quota: int, demands: List[Tuple[Set[str], int]]) -> bool:
    """`quota` groups complete, and every demand of `bound_demands` met."""
    keys = {group.key for group in complete}
    return len(keys) >= quota and all(len(keys & due) >= must for due, must in demands)


def _past(group: PoolGroup, step: int, bound: int) -> bool:
    """Held after the cut of `step`, `group` would be trained at step + 1 or later by a trainer
    holding version step or later: past the bound if its oldest token's version v has step - v > bound."""
    oldest = group.oldest_version()
    return oldest is not None and step - oldest > bound


def _oldest_or_new(group: PoolGroup) -> float:
    """The group's oldest token version (a group without tokens counts as newest)."""
    oldest = group.oldest_version()
    return float("inf") if oldest is None else float(oldest)
