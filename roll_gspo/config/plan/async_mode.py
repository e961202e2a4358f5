"""How far generation runs ahead of training (`async_generation_ratio`): the facts the loop, the rollout
sources and the old-log-prob choice read. The key's rules are `roll_gspo.config.checks.async_rollout`'s."""
from __future__ import annotations

from typing import Optional

from roll_gspo.schema.config import PipelineConfig

KEY = "async_generation_ratio"


# Why `old_logprob_source: auto` takes the rollout engine's log-probs with it (rollout_logprobs).
ASYNC_OLD_LOGPROBS = (f"{KEY} >= 1 trains on responses sampled by earlier weights (k >= 2: several versions per "
                      f"response), which only the rollout engine's per-token log-probs still describe")


def generates_ahead(cfg: PipelineConfig) -> bool:
    """The rollout engine generates the next step's responses while the trainer trains."""
    return bool(cfg.async_generation_ratio)


def staleness_bound(cfg: PipelineConfig) -> Optional[int]:
    """k of `async_generation_ratio: k` for k >= 2 (request pools, partial rollouts, the staleness
    bound); None for 0 and 1, whose paths are unchanged."""
    ratio = cfg.async_generation_ratio
    return int(ratio) if ratio >= 2 else None
