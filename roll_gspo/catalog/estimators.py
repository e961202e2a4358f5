"""Advantage estimators by name, each with the facts the rest of the project asks about it.

`ESTIMATORS` is the one list: the schema's `adv_estimator` choices and help, the critic and agentic
checks, the RLVR registry of estimator functions (`roll_gspo.algorithms.advantages`) and the agentic
pipeline's choice between whole-trajectory and per-turn advantages read it. Adding an estimator is a
line here plus its function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

GRANULARITIES = ("response", "token", "turn")
PIPELINES = ("rlvr", "agentic")


@dataclass(frozen=True)
class Estimator:
    """What an advantage estimator needs and where it runs.

    `granularity` is what one advantage value covers: a whole response (or trajectory), a token,
    or one turn of a multi-turn episode. `min_group` is the RLVR group size it needs (a group
    baseline of one response is the response itself). `help` is its phrase in the schema's help.
    `components`: it reads the reward workers' named parts of each reward (`gdpo_reward_keys`), not
    only their sum, so every reward block must send them.
    """
    name: str
    needs_critic: bool
    pipelines: Tuple[str, ...]
    granularity: str
    help: str
    min_group: int = 1
    components: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{self.name}: granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if not self.pipelines or set(self.pipelines) - set(PIPELINES):
            raise ValueError(f"{self.name}: pipelines must be a non-empty subset of {PIPELINES}")


# In the order the schema lists them (the loader's "valid values" and the config reference).
ESTIMATORS: Dict[str, Estimator] = {e.name: e for e in (
    Estimator("reinforce", False, ("rlvr", "agentic"), "token", "reward-to-go"),
    Estimator("grpo", False, ("rlvr", "agentic"), "response", "group z-score", min_group=2),
    Estimator("rloo", False, ("rlvr",), "response", "leave-one-out", min_group=2),
    Estimator("gdpo", False, ("rlvr",), "response", "components z-scored apart",
              min_group=2, components=True),
    Estimator("step_reinforce", False, ("agentic",), "turn", "per-turn return"),
    Estimator("gae", True, ("rlvr",), "token", "GAE with a critic"),
)}


def names(pipeline: str = "", needs_critic: bool = False) -> List[str]:
    """The estimators (in `ESTIMATORS`' order) a pipeline takes, or those needing a critic."""
    return [e.name for e in ESTIMATORS.values()
            if (not pipeline or pipeline in e.pipelines) and (not needs_critic or e.needs_critic)]


def help_text() -> str:
    """The `adv_estimator` help: each estimator, the pipelines that take it, and its phrase (the
    details are in the docs it links)."""
    return ("Advantage estimator (pipelines): "
            + "; ".join(f"`{e.name}` ({', '.join(e.pipelines)}): {e.help}" for e in ESTIMATORS.values())
            + " ([algorithm.md](algorithm.md), agentic: [agentic.md](agentic.md#rewards-and-advantages)).")
