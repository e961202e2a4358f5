"""Episodes in flight across weight updates (`async_generation_ratio` k >= 2 in agentic runs): the
pool of episode groups, its cut between turns, and the staleness bound per turn. Pure Python over
the episode runner (roll_gspo.agentic.rollout) and a turn submitter; no Ray.

`EpisodePool.advance(specs, seed_bases, group_size, quota, step, bound, submit)`:

1. the new groups (`group_size` episodes of one env seed each, their turns' seeds fixed when they
   join) join the held ones;
2. the episodes play on, one request per turn, env steps in threads: a held episode continues with
   its next turn (its whole context prefilled under the current weights), a new one starts with
   its reset;
3. **the cut, between turns.** A turn's slot is (its round, its group's order): its round counts
   the episode's turns within the advance (its 1st, 2nd, ... turn of this advance), and groups are
   ordered as they joined. A group completes at the slot (R_g, its order), R_g the most turns one
   of its episodes plays in the advance before it ends (0 for a group complete before). The advance
   plays the turns up to T* = the `quota`-th smallest completion slot, and at least as far as the
   staleness bound needs (`bound_demands`): up to the completion of every group at its last chance
   (held, and past the bound if still incomplete at this cut), however many, and for each later
   advance j up to the m_j-th completion among the groups due by then, so that at most j * `quota`
   of them are left for the j advances that follow. So a long episode gets k advances and is then
   finished rather than dropped for its length, and with at most k * `quota` groups in the pool
   none is dropped. So the first `quota` groups to complete, in rounds of turns and then in the
   order they joined, complete; the others stop between two turns.
   A turn starts only once it is certain to be within the cut (`turn_allowed`, from what every
   group has played so far), so which turns an advance plays depends on the episodes alone, never
   on timing: env latencies and the engine's batching change when a turn runs, not whether. No
   turn is ever cut: at the end of an advance every episode has ended, or has had its env step and
   waits for its next turn; the engine holds nothing;
4. `quota` complete groups return, the oldest first (their oldest turn's version, then the order
   they joined); complete groups beyond the quota are held. Held groups whose oldest turn's version
   v has step - v > bound are dropped and counted: trained at step + 1 or later, by a trainer of
   version step or later, they would be past the bound.

Every turn is sampled by one version (the weights change only between advances), so its tokens'
rollout log-probs are exactly that version's; the staleness of a trajectory is measured from its
oldest turn.

Checkpoints: `state()` is the held groups as plain data (transcripts, ids, log-probs, per-turn
versions, seeds); `load_state` rebuilds each held episode's env by replaying it
(`EpisodeRunner.replay`: a fresh env of the episode's seed, reset, then its actions in order), and
refuses an env whose rewards do not come back as recorded (not deterministic).
"""
from __future__ import annotations

import dataclasses
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from roll_gspo.agentic.episodes import turn_seed
from roll_gspo.agentic.rollout import EpisodeProgress, EpisodeRunner, SubmitFn, TurnGate
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory
from roll_gspo.distributed.staleness import deadline_demands


@dataclasses.dataclass
class EpisodeGroup:
    """`group_size` episodes of one env seed (the advantage's baseline set), in flight together."""

    key: str  # unique per pool, in the order groups joined
    order: int
    episodes: List[Trajectory]
    seed_bases: List[int]  # per episode: its turn k samples with turn_seed(base, k)

    @property
    def complete(self) -> bool:
        return all(t.done for t in self.episodes)

    def oldest_version(self) -> Optional[int]:
        """The oldest weight version among the group's turns; None before it has one."""
        return min((v for t in self.episodes for v in t.turn_versions), default=None)


@dataclasses.dataclass(frozen=True)
class GroupRounds:
    """What a group's episodes have played so far in an advance: `lower` <= R_g, exact when
    complete; `order`: the group's place in the pool (the second key of a slot)."""

    lower: int
    complete: bool
    order: int


@dataclasses.dataclass
class EpisodeCounts:
    """What one `advance` did."""

    complete: int = 0  # groups returned
    partial_groups: int = 0  # groups held after the cut (in flight, or complete beyond the quota)
    dropped_past_bound: int = 0  # held groups dropped: their oldest turn would be trained past the bound
    continuations: int = 0  # held episodes (with a turn) continued under the current weights
    reprefill_tokens: int = 0  # the context ids of those episodes, prefilled again under the new weights
    new_groups: int = 0  # groups that joined
    turns: int = 0  # turns played
    rounds: int = 0  # the most turns an episode played in the advance

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


def group_rounds(progress: Dict[int, EpisodeProgress], group_of: Dict[int, EpisodeGroup]) -> Dict[str, GroupRounds]:
    """Per group, from its episodes' progress: R_g's lower bound (an ended or busy episode has
    played its turns, a ready one will play one more) and whether the group is complete."""
    lower: Dict[str, int] = {}
    complete: Dict[str, bool] = {}
    order: Dict[str, int] = {}
    for index, p in progress.items():
        group = group_of[index]
        lower[group.key] = max(lower.get(group.key, 0), p.turns + (p.state == "ready"))
        complete[group.key] = complete.get(group.key, True) and p.state == "ended"
        order[group.key] = group.order
    return {key: GroupRounds(lower[key], complete[key], order[key]) for key in lower}


Demands = Sequence[Tuple[AbstractSet[str], int]]  # (group keys, m): at least m of them complete


def bound_demands(groups: Sequence[EpisodeGroup], step: int, bound: int, quota: int) -> List[Tuple[Set[str], int]]:
    """What the cut of `step` waits for so that the bound drops no group for its length (the episode
    pool's groups; the rule: roll_gspo.distributed.staleness.deadline_demands)."""
    return deadline_demands({group.key: group.oldest_version() for group in groups}, step, bound, quota)


def turn_allowed(groups: Dict[str, GroupRounds], quota: int, demands: Demands, r: int, order: int) -> Optional[bool]:
    """Whether the turn of slot (round `r`, group order `order`) is within the cut T* = the latest
    of T_Q and each demand's T_d (see the module): True when certain, False when certainly not,
    None while the groups' play so far leaves it open. T_Q >= (r, order) iff fewer than `quota`
    groups complete at a slot before it; T_d likewise over a demand's keys and its m."""
    def before(keys) -> Tuple[int, int]:  # groups (possibly, certainly) complete at a slot before (r, order)
        slots = [groups[key] for key in keys]
        possibly = [g for g in slots if g.lower < r or (g.lower == r and g.order < order)]
        return len(possibly), sum(g.complete for g in possibly)

    terms = [(groups.keys(), quota)] + [(keys & groups.keys(), must) for keys, must in demands if must]
    counted = [(before(keys), must) for keys, must in terms]
    if any(possibly < must for (possibly, _), must in counted):
        return True
    return False if all(certainly >= must for (_, certainly), must in counted) else None


class EpisodePool:
    """The episode groups held across `advance` calls (see the module); envs by episode index."""

    def __init__(self, runner: EpisodeRunner):
        self.runner = runner
        self.held: List[EpisodeGroup] = []
        self.envs: Dict[int, Any] = {}
        self.groups_added = 0
        self.episodes_added = 0  # episode indices are unique per pool (they key envs and requests)

    def advance(self, specs: Sequence[EpisodeSpec], seed_bases: Sequence[int], group_size: int, quota: int,
                step: int, bound: int, submit: SubmitFn) -> Tuple[List[EpisodeGroup], EpisodeCounts]:
        """Add `specs` (consecutive groups of `group_size`) as new groups, play to the cut, return
        `quota` complete groups (oldest first) and the counts; see the module."""
        counts = EpisodeCounts()
        for start in range(0, len(specs), group_size):
            members = [dataclasses.replace(spec, index=self.episodes_added + k)
                       for k, spec in enumerate(specs[start:start + group_size])]
            self.episodes_added += len(members)
            self.held.append(EpisodeGroup(f"e{self.groups_added}", self.groups_added,
                                          [Trajectory(spec) for spec in members],
                                          [int(b) for b in seed_bases[start:start + group_size]]))
            self.groups_added += 1
            counts.new_groups += 1
        groups = self.held
        if quota > len(groups):
            raise ValueError(f"a quota of {quota} complete groups from a pool of {len(groups)}")
        trajectories = [t for g in groups for t in g.episodes]
        continued = [t for t in trajectories if not t.done and t.turn_versions]  # held after a turn
        counts.continuations = len(continued)
        counts.reprefill_tokens = sum(t.length for t in continued)
        seeds = {t.spec.index: base for g in groups for t, base in zip(g.episodes, g.seed_bases)}
        played = self.runner.play(trajectories, self.envs, submit, lambda index, turn: turn_seed(seeds[index], turn),
                                  gate=self._gate(groups, quota, bound_demands(groups, step, bound, quota)))
        counts.turns = sum(played.values())
        counts.rounds = max(played.values(), default=0)
        complete = sorted((g for g in groups if g.complete), key=lambda g: (_oldest_or_new(g), g.order))
        if len(complete) < quota:
            raise RuntimeError(f"an advance ended with {len(complete)} of {quota} groups complete")
        taken = complete[:quota]
        taken_keys = {g.key for g in taken}
        self.held = []
        for group in groups:
            if group.key in taken_keys:
                continue
            if _past(group, step, bound):
                counts.dropped_past_bound += 1
                for t in group.episodes:
                    self.envs.pop(t.spec.index, None)
            else:
                self.held.append(group)
        counts.complete, counts.partial_groups = len(taken), len(self.held)
        return taken, counts

    @staticmethod
    def _gate(groups: List[EpisodeGroup], quota: int, demands: Demands) -> TurnGate:
        """`EpisodeRunner.play`'s gate: a turn is played once it is certainly within the cut."""
        group_of = {t.spec.index: g for g in groups for t in g.episodes}

        def gate(progress: Dict[int, EpisodeProgress]) -> Callable[[int, int], Optional[bool]]:
            rounds = group_rounds(progress, group_of)
            return lambda index, r: turn_allowed(rounds, quota, demands, r, group_of[index].order)

        return gate

    # -- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """The held groups as plain lists and dicts (what a checkpoint saves; envs are replayed)."""
        return {"groups_added": self.groups_added, "episodes_added": self.episodes_added,
                "held": [{"key": g.key, "order": g.order, "seed_bases": list(g.seed_bases),
                          "episodes": [dataclasses.asdict(t) for t in g.episodes]} for g in self.held]}

    def load_state(self, state: Dict[str, Any]) -> None:
        """Back to the groups `state()` returned, each held episode's env replayed from its seed and
        actions (a ValueError for an env that does not replay as recorded)."""
        self.groups_added, self.episodes_added = int(state["groups_added"]), int(state["episodes_added"])
        self.held, self.envs = [], {}
        for g in state["held"]:
            episodes = [Trajectory(**{**e, "spec": EpisodeSpec(**e["spec"])}) for e in g["episodes"]]
            self.held.append(EpisodeGroup(g["key"], int(g["order"]), episodes, [int(b) for b in g["seed_bases"]]))
            for t in episodes:
                if not t.done:
                    self.envs[t.spec.index] = self.runner.replay(t)


def _past(group: EpisodeGroup, step: int, bound: int) -> bool:
    """Held after the cut of `step`, `group` would be trained at step + 1 or later by a trainer of
    version step or later: past the bound if its oldest turn's version v has step - v > bound."""
    oldest = group.oldest_version()
    return oldest is not None and step - oldest > bound


def _oldest_or_new(group: EpisodeGroup) -> float:
    """The group's oldest turn version (a group without a turn counts as newest)."""
    oldest = group.oldest_version()
    return float("inf") if oldest is None else float(oldest)
