"""The policy loss a run trains with: the keywords the trainer passes, and its one-line description for
`--dry-run`. The keys' checks are `roll_gspo.config.checks.policy_loss`'s."""
from __future__ import annotations

from typing import Any, Dict

from roll_gspo.catalog.policy_losses import LOSS_SPECS, canonical_loss
from roll_gspo.schema.config import PipelineConfig


def policy_loss_options(cfg: PipelineConfig) -> Dict[str, Any]:
    """The keywords of `policy_loss(..., options=)` for this config: the running loss's own keys."""
    spec = LOSS_SPECS[canonical_loss(cfg.policy_loss)]
    return {key: getattr(cfg, key) for key in spec.keys}


def describe_policy_loss(cfg: PipelineConfig) -> str:
    """One line for `--dry-run`: which loss runs, on which ratio, with which bounds and aggregation."""
    name = canonical_loss(cfg.policy_loss)
    spec = LOSS_SPECS[name]
    if name == "clip":
        what = {"seq": "GSPO (sequence ratio)", "token": "PPO/GRPO (token ratio)",
                "gspo-token": "GSPO-token"}[cfg.importance_sampling]
        parts = [f"clip: {what} clipped surrogate, ratio in [{1 - cfg.pg_clip_low:g}, {1 + cfg.pg_clip_high:g}]"]
        if cfg.dual_clip_loss:
            parts.append(f"dual clip c = {cfg.dual_clip_c:g}")
    else:
        parts = [f"{name}: {spec.title}"]
        if spec.reads_clip:
            bounds = (f"log-ratio in [-{cfg.pg_clip_low:g}, {cfg.pg_clip_high:g}]" if name == "gmpo" else
                      f"ratio in [{1 - cfg.pg_clip_low:g}, {1 + cfg.pg_clip_high:g}]")
            parts.append(bounds)
        if name not in ("gmpo", "vespo", "reinforce") and spec.ratio_levels != ("token",):
            parts.append(f"importance_sampling {cfg.importance_sampling}")
        parts += [f"{key} {getattr(cfg, key)}" for key in spec.keys]
    parts.append(f"loss_agg_mode {cfg.loss_agg_mode}")
    return "; ".join(parts)
