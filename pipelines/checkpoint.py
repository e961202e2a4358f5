"""Saving, resuming and ending a run: the checkpoint's files and driver state, restoring them, when
a checkpoint is due, the line a graceful stop prints, and the final model a finished run leaves
(`roll_gspo.lifecycle` holds the folder protocol and the signal handling these use)."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, List, Optional, Sequence

import torch

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.lifecycle.checkpoint import checkpoint_base
from roll_gspo.config.plan.rollout_logprobs import OldLogprobChoice
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster, WorkerDiedError
from roll_gspo.lifecycle.checkpoint import (CheckpointError, begin_checkpoint, checkpoint_failure,
    commit_checkpoint, discard, read_state)
from roll_gspo.lifecycle.graceful_stop import GracefulStop, resume_command
from roll_gspo.lifecycle.reshape import LOAD_NATIVE, SHAPES_KEY, ResumeAction, shapes_record

logger = logging.getLogger("roll_gspo")
ROLLOUT_BUFFER_FILE = "rollout_buffer.pt"  # the rollouts generated ahead (async), saved with the checkpoint
ROLLOUT_POOL_FILE = "rollout_pool.pt"  # k >= 2: each rollout rank's request pool (held partial groups)
NEXT_ROLLOUT_FILE = "next_rollout.pt"  # what checkpoints before the rollout buffer saved instead: one rollout


def write_checkpoint(cfg: PipelineConfig, actor_train: Cluster, step: int, *, buffered: List[Batch],
                     driver_state: dict, critic: Optional[Cluster] = None,
                     pool_states: Optional[List[Any]] = None) -> str:
    """The trainer ranks' state (and the critic's, PPO), the rollouts generated ahead (async) and the
    driver's state (`driver_state`: the source's sampler and running reward stats, where old
    log-probs come from) and, with `async_generation_ratio` k >= 2, the rollout ranks' request pools
    (`pool_states`, one file beside the rollouts generated ahead); written to a temporary folder, fsynced, renamed into place
    (`roll_gspo.lifecycle.checkpoint`). Returns the folder."""
    output_dir = checkpoint_base(cfg)
    folder = begin_checkpoint(output_dir, step)
    try:
        actor_train.execute_all("save_checkpoint", folder)
        if critic is not None:  # in its own subfolder (roll_gspo.workers.critic)
            critic.execute_all("save_checkpoint", folder)
        if buffered:  # async: their prompts are drawn already, the weights that sampled them gone
            torch.save(buffered, os.path.join(folder, ROLLOUT_BUFFER_FILE))
        if pool_states is not None:  # the partial responses in flight, continued after a resume
            torch.save(pool_states, os.path.join(folder, ROLLOUT_POOL_FILE))
    except WorkerDiedError:
        discard(folder)
        raise
    except Exception as exc:  # e.g. disk full: OSError, or torch.save's RuntimeError
        message = checkpoint_failure(output_dir, step, exc)
        discard(folder)
        raise CheckpointError(message) from exc
    # The training shape it was written with (engine, ranks, ZeRO stage, dtype): what a resume on
    # another shape compares (roll_gspo.lifecycle.reshape).
    state = {"step": step, **driver_state, SHAPES_KEY: shapes_record(cfg)}
    return commit_checkpoint(folder, state, output_dir, step, cfg.save_total_limit)


def restore_trainer(folder: str, actor_train: Cluster, critic: Optional[Cluster] = None,
                    actions: Sequence[ResumeAction] = ()) -> dict:
    """Load the trainer ranks' state (and the critic's, PPO) from `folder`, each role as its
    `actions` say (`resume_actions`: exact, resharded or converted; default: as written); returns
    the driver state saved there (its `step` is the last one done)."""
    state = read_state(folder)
    modes = {action.role: action.load_mode for action in actions}
    actor_train.execute_all("load_checkpoint", folder, modes.get("actor_train", LOAD_NATIVE))
    if critic is not None:
        critic.execute_all("load_checkpoint", folder, modes.get("critic", LOAD_NATIVE))
    return state


def resumed_old_logprobs(choice: OldLogprobChoice, state: dict, step: int) -> OldLogprobChoice:
    """`auto` outside fp32: the old log-prob source the measured gap had led to by `step`."""
    if choice.max_gap is not None and state.get("old_logprob_source"):
        return dataclasses.replace(choice, source=state["old_logprob_source"],
                                   reason=f"auto: as at step {step} (resumed)")
    return choice


def load_buffered(folder: str) -> List[Batch]:
    """async: the rollouts generated ahead (by older weights) that were saved with the checkpoint,
    oldest first; a checkpoint from before the rollout buffer holds one as `next_rollout.pt`."""
    if os.path.exists(os.path.join(folder, ROLLOUT_BUFFER_FILE)):
        return torch.load(os.path.join(folder, ROLLOUT_BUFFER_FILE), weights_only=False)
    if os.path.exists(os.path.join(folder, NEXT_ROLLOUT_FILE)):
        return [torch.load(os.path.join(folder, NEXT_ROLLOUT_FILE), weights_only=False)]
    return []


def load_pool_states(folder: str) -> Optional[List[Any]]:
    """k >= 2: the rollout ranks' request pools saved with the checkpoint (None without the file)."""
    path = os.path.join(folder, ROLLOUT_POOL_FILE)
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def checkpoint_due(cfg: PipelineConfig, step: int, stop: GracefulStop) -> bool:
    """Every save_steps, at the last step, and after the step a stop signal arrived in."""
    return bool((cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps or stop.requested)


def announce_stop(signal: str, step: int, max_steps: int, folder: str) -> None:
    """One plain line (not through the console logger, which wraps), to copy."""
    print(f"stopped by {signal} after step {step} of {max_steps}; checkpoint "
          f"{folder}. Resume with: {resume_command()}", file=sys.stderr, flush=True)


def save_final_model(cfg: PipelineConfig, actor_train: Cluster) -> None:
    """A finished run's weights as a Hugging Face folder, `<output_dir>/final_model`."""
    final_dir = os.path.join(cfg.output_dir, "final_model")
    actor_train.execute_all("save_hf_model", final_dir)
    logger.info("final model (Hugging Face format): %s", final_dir)
