"""The staleness bound's deadlines, shared by the request pools (RLVR prompt groups,
roll_gspo.strategies.request_pool) and the episode pool (agentic, roll_gspo.agentic.episode_pool):
what an advance's cut must wait for so that the bound drops no group for its length."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Set, Tuple


def deadline_demands(oldest: Mapping[str, Optional[int]], step: int, bound: int,
                     quota: int) -> List[Tuple[Set[str], int]]:
    """Pairs (keys, m): at least m of the groups `keys` complete at the cut of `step`.

    `oldest`: each held group's oldest weight version (None: nothing sampled, nothing to age). A
    group of oldest version v is due j advances on: held past the cut of step + j it is dropped
    once step + j - v > bound. Due now (its last chance): all of them complete, whatever their
    number, so a long one is finished, not dropped. Due within j >= 1 advances: the j later
    advances take j * quota (the oldest first), so enough complete now that no more are left (at
    most `quota`). Earliest deadline first: with no more than (j + 1) * quota groups due within j
    advances, for every j, none is ever dropped."""
    due: Dict[str, int] = {key: max(0, bound + 1 - (step - version)) for key, version in oldest.items()
                           if version is not None}
    demands = []
    for j in sorted(set(due.values())):
        keys = {key for key, d in due.items() if d <= j}
        must = len(keys) if j == 0 else min(quota, len(keys) - j * quota)
        if must > 0:
            demands.append((keys, must))
    return demands
