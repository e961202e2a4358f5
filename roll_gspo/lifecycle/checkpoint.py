"""Checkpoint folders `<output_dir>/checkpoints/step_<N>/`, crash-safe at every moment.

* A checkpoint is written into `.tmp_step_<N>`, fsynced (files, then folders), marked `COMPLETE`
  and renamed to `step_<N>`: the rename is the commit, so a folder named `step_<N>` is whole.
* Pruning renames a folder to `step_<N>.deleting` before removing it, so a deletion cut short
  never leaves something `auto` could pick; leftovers of both kinds are removed at the next start.
* An explicit resume from an older step moves the newer checkpoints aside, into
  `checkpoints/abandoned/<time>_from_step_<N>/` (kept, never deleted), so neither pruning nor a
  later `auto` mixes the abandoned branch with the new one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any, Dict, List, Optional

logger = logging.getLogger("roll_gspo")
COMPLETE_MARKER = "COMPLETE"
STATE_FILE = "pipeline_state.json"
TMP_PREFIX = ".tmp_step_"
DELETING_SUFFIX = ".deleting"
ABANDONED_DIR = "abandoned"
_NAME = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, output_dir not writable, a rank failed)."""


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def checkpoint_step(path: str) -> int:
    match = _NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    if not match:
        raise ValueError(f"{path!r} is not a checkpoint folder (expected a name step_<N>)")
    return int(match.group(1))


def complete_checkpoints(output_dir: str) -> List[str]:
    """Complete checkpoint folders of the current branch, oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _NAME.fullmatch(name)
        if match and os.path.exists(os.path.join(root, name, COMPLETE_MARKER)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def remove_leftovers(output_dir: str) -> None:
    """Delete what a crash left behind: unfinished writes and interrupted deletions."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith(TMP_PREFIX) or name.endswith(DELETING_SUFFIX):
            logger.info("removing an unfinished checkpoint folder left by an earlier run: %s", name)
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def resolve_resume(output_dir: str, resume_from_checkpoint: Optional[str]) -> Optional[str]:
    """The checkpoint to resume from, or None for a fresh start.

    A fresh start over existing checkpoints is refused: silently training over them is how runs
    get lost. An explicit checkpoint older than this output_dir's newest moves the newer ones aside."""
    remove_leftovers(output_dir)
    existing = complete_checkpoints(output_dir)
    if resume_from_checkpoint is None:
        if existing:
            raise FileExistsError(
                f"{output_dir} already holds checkpoints ({os.path.basename(existing[-1])} newest): set "
                f"resume_from_checkpoint=auto to continue, or choose another output_dir")
        return None
    if resume_from_checkpoint == "auto":
        return existing[-1] if existing else None
    path = resume_from_checkpoint
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        raise FileNotFoundError(f"resume_from_checkpoint: {path!r} is not a complete checkpoint "
                                f"(no {COMPLETE_MARKER} file)")
    move_aside_newer(output_dir, checkpoint_step(path))
    return path


def move_aside_newer(output_dir: str, step: int) -> Optional[str]:
    """Rename checkpoints newer than `step` into `checkpoints/abandoned/<time>_from_step_<step>/`;
    returns that folder, or None when there were none."""
    root = checkpoint_root(output_dir)
    newer = [os.path.join(root, name) for name in (os.listdir(root) if os.path.isdir(root) else [])
             if _NAME.fullmatch(name) and int(_NAME.fullmatch(name).group(1)) > step]
    if not newer:
        return None
    aside = os.path.join(root, ABANDONED_DIR, time.strftime("%Y%m%dT%H%M%S") + f"_from_step_{step}")
    os.makedirs(aside)
    for path in newer:
        os.rename(path, os.path.join(aside, os.path.basename(path)))
    _fsync_dir(root)
    logger.warning("resuming from step %d: newer checkpoints %s moved aside to %s (kept; the run continues "
                   "from step %d)", step, sorted(os.path.basename(p) for p in newer), aside, step)
    return aside


def begin_checkpoint(output_dir: str, step: int) -> str:
    """A fresh temporary folder for step `step`'s checkpoint; `commit_checkpoint` publishes it."""
    root = checkpoint_root(output_dir)
    path = os.path.join(root, f"{TMP_PREFIX}{step}")
    try:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.makedirs(path)
    except OSError as exc:
        raise CheckpointError(checkpoint_failure(output_dir, step, exc)) from exc
    return path


def commit_checkpoint(tmp_path: str, state: Dict[str, Any], output_dir: str, step: int, keep: int) -> str:
    """Write the driver's state, fsync everything, rename `tmp_path` to `step_<step>`, then prune
    to the newest `keep`. Returns the checkpoint's folder."""
    final = os.path.join(checkpoint_root(output_dir), f"step_{step}")
    try:
        with open(os.path.join(tmp_path, STATE_FILE), "w") as handle:
            json.dump(state, handle, indent=1)
        _fsync_tree(tmp_path)
        with open(os.path.join(tmp_path, COMPLETE_MARKER), "w") as handle:
            handle.write("ok\n")
            handle.flush()
            os.fsync(handle.fileno())
        if os.path.exists(final):  # an older folder of the same step (e.g. an incomplete one)
            retire(final)
        os.rename(tmp_path, final)
        _fsync_dir(os.path.dirname(final))
    except OSError as exc:
        message = checkpoint_failure(output_dir, step, exc)
        discard(tmp_path)
        raise CheckpointError(message) from exc
    prune(output_dir, keep)
    logger.info("checkpoint saved: %s", final)
    return final


def checkpoint_failure(output_dir: str, step: int, exc: BaseException) -> str:
    """The error message of a failed checkpoint write; call it before discarding the partial
    folder, whose size tells whether the disk is full."""
    root = checkpoint_root(output_dir)
    existing = complete_checkpoints(output_dir)
    previous = (f"the previous checkpoint {existing[-1]} is intact" if existing
                else "there is no earlier checkpoint")
    cause = getattr(exc, "cause", None) or exc  # a rank's error arrives wrapped by Ray
    lines = str(cause).strip().splitlines()
    reason = f"{type(cause).__name__}: {lines[-1] if lines else ''}"
    full = ""
    try:
        free = shutil.disk_usage(root).free
        needed = _folder_bytes(existing[-1]) if existing else 0
        if free < max(needed, 1 << 20):
            full = (f" The disk looks full: {free / 2**20:.1f} MiB free under {root}, a checkpoint takes "
                    f"{needed / 2**20:.1f} MiB (and save_total_limit + 1 of them exist while one is written).")
    except OSError:
        pass
    return (f"could not write the checkpoint of step {step} under {root}: {reason}.{full} {previous}; free "
            f"disk space or fix the folder's permissions, then resume with resume_from_checkpoint=auto")


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)


def discard(tmp_path: str) -> None:
    shutil.rmtree(tmp_path, ignore_errors=True)


def prune(output_dir: str, keep: int) -> None:
    for old in complete_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        retire(old)


def retire(path: str) -> None:
    """Delete a checkpoint folder so that no moment of it looks complete: renamed first, then
    removed (a crash in between leaves a `.deleting` folder, removed at the next start)."""
    doomed = path.rstrip(os.sep) + DELETING_SUFFIX
    if os.path.exists(doomed):
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    _fsync_dir(os.path.dirname(doomed))
    shutil.rmtree(doomed)


def read_state(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, STATE_FILE)) as handle:
        return json.load(handle)


def _fsync_tree(path: str) -> None:
    """fsync every file, then every folder (deepest first), of a tree."""
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_base(cfg) -> str:
    """The folder whose `checkpoints/` holds the run's checkpoints: checkpoint_config.output_dir
    when set, else output_dir (never timestamped, so `resume_from_checkpoint: auto` finds them)."""
    return cfg.checkpoint_config.output_dir or cfg.output_dir
