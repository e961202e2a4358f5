"""Checkpoint folders: `<output_dir>/checkpoints/step_<N>/`, complete only once `COMPLETE` is
written last; older ones are removed only after a newer one is complete."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any, Dict, List, Optional

logger = logging.getLogger("roll_gspo")
COMPLETE_MARKER = "COMPLETE"
STATE_FILE = "pipeline_state.json"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> List[str]:
    """Complete checkpoint folders, oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = re.fullmatch(r"step_(\d+)", name)
        if match and os.path.exists(os.path.join(root, name, COMPLETE_MARKER)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def resolve_resume(output_dir: str, resume_from_checkpoint: Optional[str]) -> Optional[str]:
    """The checkpoint to resume from, or None for a fresh start.

    A fresh start over existing checkpoints is refused: silently training over them is how runs
    get lost."""
    existing = complete_checkpoints(output_dir)
    if resume_from_checkpoint is None:
        if existing:
            raise FileExistsError(
                f"{output_dir} already holds checkpoints ({os.path.basename(existing[-1])} newest): set "
                f"resume_from_checkpoint=auto to continue, or choose another output_dir")
        return None
    if resume_from_checkpoint == "auto":
        return existing[-1] if existing else None
    if not os.path.exists(os.path.join(resume_from_checkpoint, COMPLETE_MARKER)):
        raise FileNotFoundError(f"resume_from_checkpoint: {resume_from_checkpoint!r} is not a complete checkpoint "
                                f"(no {COMPLETE_MARKER} file)")
    return resume_from_checkpoint


def new_checkpoint_dir(output_dir: str, step: int) -> str:
    path = os.path.join(checkpoint_root(output_dir), f"step_{step}")
    if os.path.exists(path):  # an incomplete leftover of a crash
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def finish_checkpoint(path: str, state: Dict[str, Any], output_dir: str, keep: int) -> None:
    with open(os.path.join(path, STATE_FILE), "w") as handle:
        json.dump(state, handle, indent=1)
    with open(os.path.join(path, COMPLETE_MARKER), "w") as handle:
        handle.write("ok\n")
    for old in complete_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint saved: %s", path)


def read_state(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, STATE_FILE)) as handle:
        return json.load(handle)
