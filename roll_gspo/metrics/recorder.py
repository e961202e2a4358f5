"""Metrics out: one JSON object per step in <output_dir>/metrics.jsonl, the `track_with` tracker
(TensorBoard, wandb, swanlab, mlflow, stdout: roll_gspo.metrics.trackers), a compact console line, and a
PNG plot of reward and validation accuracy at the end."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Dict, List, Optional

logger = logging.getLogger("roll_gspo")

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = ("reward/mean", "val/accuracy", "traj/reward_mean", "traj/success_rate", "traj/num_turns_mean",
                "val/success_rate", "actor/clipfrac", "actor/ratio_mean", "actor/entropy", "actor/grad_norm",
                "rollout/logprob_gap", "response/length_mean", "time/step_s")


# How the console line names them (the last path part otherwise).
CONSOLE_NAMES = {"reward/mean": "reward", "val/accuracy": "val_acc", "traj/reward_mean": "reward",
                 "traj/success_rate": "success", "traj/num_turns_mean": "turns", "val/success_rate": "val_success",
                 # mean |trainer - rollout engine| per-token log-prob on the synced weights (bf16: ~1e-2)
                 "rollout/logprob_gap": "lp_gap"}


class MetricsTracker:
    """metrics.jsonl (every step) plus the `track_with` tracker (roll_gspo.metrics.trackers).

    `resume_step`: the step a resumed run continues after (None: a fresh run). Rows of later
    steps, written by the run that crashed or was stopped, move to a side file, and every tracker
    continues from `resume_step + 1` without overlapping what it already holds."""

    def __init__(self, output_dir: str, logging_dir: str, track_with: str, tracker_kwargs: Dict[str, Any],
                 resume_step: Optional[int] = None, exp_name: Optional[str] = None,
                 config: Optional[Dict[str, Any]] = None):
        from roll_gspo.metrics.trackers import TrackerContext, make_tracker

        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step is None:
            if os.path.exists(self.path):
                os.replace(self.path, self.path + ".previous")  # keep, never silently overwrite
        else:
            move_rows_after(self.path, resume_step)
        self.file = open(self.path, "a", buffering=1)
        context = TrackerContext(exp_name or os.path.basename(os.path.normpath(output_dir)), output_dir,
                                 logging_dir, config or {}, resume_step)
        self.tracker = make_tracker(track_with, context, tracker_kwargs)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        record = {"step": step, **{k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log(step, {k: v for k, v in record.items() if k != "step" and v is not None})

    @staticmethod
    def console_line(step: int, max_steps: int, metrics: Dict[str, float]) -> str:
        parts = [f"step {step}/{max_steps}"]
        for key in CONSOLE_KEYS:
            if key in metrics:
                parts.append(f"{CONSOLE_NAMES.get(key, key.split('/')[-1])} {metrics[key]:.4g}")
        return " | ".join(parts)

    def close(self) -> None:
        self.file.close()
        if self.tracker is not None:
            self.tracker.close()


def move_rows_after(path: str, step: int) -> Optional[str]:
    """Keep rows up to `step` in `path`; move later rows (and a line torn by a crash) to
    `<path minus .jsonl>.after_step_<step>.<time>.jsonl`. Returns the side file, or None."""
    if not os.path.exists(path):
        return None
    keep, moved = [], []
    with open(path) as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                row_step = None
            (keep if row_step is not None and row_step <= step else moved).append(line.rstrip("\n") + "\n")
    if not moved:
        return None
    side = f"{path[:-len('.jsonl')] if path.endswith('.jsonl') else path}.after_step_{step}.{time.strftime('%Y%m%dT%H%M%S')}.jsonl"
    with open(side, "w") as handle:
        handle.writelines(moved)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        handle.writelines(keep)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    logger.warning("resuming after step %d: %d metrics rows of later steps moved to %s", step, len(moved), side)
    return side


def read_metrics(path: str) -> List[Dict[str, Any]]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_metrics(metrics_path: str, png_path: str, title: Optional[str] = None) -> None:
    """Training reward per step and validation accuracy on validation steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["reward/mean"]) for r in records if r.get("reward/mean") is not None]
    val = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    if train:
        ax.plot(*zip(*train), label="train reward (mean)", alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation accuracy")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or os.path.basename(os.path.dirname(metrics_path)))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
