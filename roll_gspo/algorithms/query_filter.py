"""ROLL's query filters (dynamic sampling): which prompts' groups of G scores carry a signal.

A group whose G responses all score the same has zero advantage under a group baseline, so it
only dilutes the batch; DAPO drops such groups and samples more prompts. ROLL's two filters, per
reward domain: `mean_filter` drops a group whose mean score is <= threshold_down or >=
threshold_up; `std_filter` drops it when the std of its scores is <= std_threshold.
"""
from __future__ import annotations

import math
from typing import Any, Dict

import torch


def keep_groups(scores: torch.Tensor, group_size: int, filter_type: str, filter_args: Dict[str, Any]) -> torch.Tensor:
    """scores: (B * G,) response scores, G = `group_size` consecutive per prompt. Returns (B,)
    bool: True for the groups the filter keeps. The std is the unbiased one (as torch.std), so
    std_threshold 0 drops exactly the groups whose scores are all equal."""
    groups = scores.float().view(-1, group_size)
    if filter_type == "no_filter":
        return torch.ones(groups.shape[0], dtype=torch.bool)
    if filter_type == "mean_filter":
        mean = groups.mean(dim=1)
        up = float(filter_args.get("threshold_up", math.inf))
        down = float(filter_args.get("threshold_down", -1.0))
        return (mean > down) & (mean < up)
    if filter_type == "std_filter":
        std = groups.std(dim=1) if group_size > 1 else torch.zeros(groups.shape[0])
        return std > float(filter_args.get("std_threshold", -1.0))
    raise ValueError(f"unknown query filter type {filter_type!r}; valid: no_filter, mean_filter, std_filter")
