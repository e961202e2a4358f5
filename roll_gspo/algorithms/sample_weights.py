"""Per-response loss masks and weights (ROLL's `max_len_mask`, `difficulty_mask`,
`error_max_len_clip`, `difficulty_loss_weight`, `length_loss_weight`), in plain torch.

Shapes: ``B`` responses, ordered in groups of ``group_size`` consecutive responses to one prompt.
The result multiplies each response's per-token loss; a weight of 0 leaves the response out of
the loss and out of the loss normalisers.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


def sample_loss_weights(scores: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor, group_size: int, *,
                        max_len_mask: bool = False, difficulty_mask: bool = False,
                        difficulty_low: float = 0.0, difficulty_high: float = 1.0,
                        error_max_len_clip: bool = False, error_max_len_threshold: int = 9999999999,
                        difficulty: Optional[torch.Tensor] = None, length_loss_weight: bool = False,
                        ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Loss weights (B,) and the fractions each mask keeps.

    scores: (B,) raw rewards. lengths: (B,) response tokens. truncated: (B,) bool, cut at the
    generation cap without an end of sequence. difficulty: (B,) in [0, 1] or None.

    * max_len_mask: 0 for truncated responses.
    * difficulty_mask: 0 for every response of a group whose mean score is <= difficulty_low or
      >= difficulty_high (all solved / none solved: no learning signal in a group baseline).
    * error_max_len_clip: keep responses scoring exactly 1, and those scoring 0 with fewer than
      error_max_len_threshold tokens (ROLL's rule; other scores are left out too).
    * difficulty (weighting): 0.5 + 1.5 * clamp(difficulty, 0, 1).
    * length_loss_weight: 1.5 - (length - min) / (max - min), over this batch.
    Weights are rescaled to mean 1 over the batch (before the masks), as ROLL does.
    """
    batch = scores.shape[0]
    keep = torch.ones(batch, dtype=torch.float32)
    metrics: Dict[str, float] = {}
    if max_len_mask:
        kept = (~truncated.bool()).float()
        keep = keep * kept
        metrics["actor/max_len_mask_ratio"] = float(kept.mean())
    if difficulty_mask:
        if batch % group_size:
            raise ValueError(f"difficulty_mask: {batch} responses are not whole groups of {group_size}")
        group_mean = scores.float().view(-1, group_size).mean(-1, keepdim=True).expand(-1, group_size).reshape(-1)
        kept = ((group_mean > difficulty_low) & (group_mean < difficulty_high)).float()
        keep = keep * kept
        metrics["actor/difficulty_mask_ratio"] = float(kept.mean())
    if error_max_len_clip:
        kept = (((scores == 0) & (lengths < error_max_len_threshold)) | (scores == 1)).float()
        keep = keep * kept
        metrics["actor/error_len_mask_ratio"] = float(kept.mean())
    weights = torch.ones(batch, dtype=torch.float32)
    if difficulty is not None:
        weights = weights * (0.5 + 1.5 * difficulty.float().clamp(0.0, 1.0))
    if length_loss_weight:
        span = (lengths.max() - lengths.min()).float()
        weights = weights * (1.5 - (lengths - lengths.min()).float() / (span + 1e-8))
    if weights.sum() > 0:
        weights = weights * (batch / weights.sum())
    metrics["actor/samples_used"] = float(keep.sum())
    metrics["actor/final_mask_ratio"] = float(keep.mean())
    return keep * weights, metrics
