"""Reading a run folder for the report: `metrics.jsonl` and the rollout files under `rollouts/`.

Everything here tolerates what a real folder holds: a line torn by a crash, a step file cut short
or not gzip at all, a field an older writer did not write. What cannot be read is skipped and
counted, so the page can say how much it is missing instead of failing on one bad file."""
from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Any, Dict, List, Optional

from roll_gspo.metrics.rollouts import read_step, step_files

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_DIR = "rollouts"


class NotARunFolder(ValueError):
    """The folder holds no metrics.jsonl: nothing a report could draw."""

    def __init__(self, folder: str):
        super().__init__(f"{folder} is not a run folder (no {METRICS_FILE})")
        self.folder = folder


@dataclasses.dataclass
class MetricsRows:
    """The rows of metrics.jsonl (one per step, the last written kept when a step repeats) and how
    many lines could not be read."""
    rows: List[Dict[str, Any]]
    unreadable_lines: int = 0


@dataclasses.dataclass
class SkippedFile:
    path: str
    reason: str


@dataclasses.dataclass
class Rollouts:
    """Every readable step file's records: `train[step]`, `val[step]`; `present` is False for a run
    without a rollouts/ folder (written before rollouts were recorded, or with recording off)."""
    present: bool
    train: Dict[int, List[Dict[str, Any]]] = dataclasses.field(default_factory=dict)
    val: Dict[int, List[Dict[str, Any]]] = dataclasses.field(default_factory=dict)
    skipped: List[SkippedFile] = dataclasses.field(default_factory=list)


def require_run_folder(folder: str) -> str:
    """The path of the folder's metrics.jsonl; `NotARunFolder` when there is none."""
    path = os.path.join(folder, METRICS_FILE)
    if not os.path.isfile(path):
        raise NotARunFolder(folder)
    return path


def read_metrics_rows(folder: str) -> MetricsRows:
    """metrics.jsonl's rows sorted by step. A resumed run may have written a step twice: the later
    row is the one that trained, so it wins. A torn or foreign line is counted, not fatal."""
    by_step: Dict[int, Dict[str, Any]] = {}
    unreadable = 0
    with open(require_run_folder(folder), encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                continue
            row = parse_metrics_line(line)
            if row is None:
                unreadable += 1
            else:
                by_step[row["step"]] = row
    return MetricsRows([by_step[s] for s in sorted(by_step)], unreadable)


def parse_metrics_line(line: str) -> Optional[Dict[str, Any]]:
    """One metrics row with an integer step and only numeric (or null) values; None when the line
    is not such a row, so one bad line costs one row."""
    try:
        row = json.loads(line)
        step = int(row["step"])
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(row, dict):
        return None
    clean = {k: v for k, v in row.items() if k != "step" and _is_number_or_null(v)}
    return {"step": step, **clean}


def _is_number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def read_rollouts(folder: str, train_dir: Optional[str] = None, val_dir: Optional[str] = None) -> Rollouts:
    """The train files `rollouts/step_N.jsonl.gz` and validation files
    `rollouts/val/step_N.jsonl.gz` (or those of a run's own `rollout_dump_dir` / `validation_data_dir`);
    a file that is not readable gzip'd JSON lines is skipped whole (its records cannot be trusted) and
    listed with its reason."""
    root = train_dir or os.path.join(folder, ROLLOUTS_DIR)
    val_root = val_dir or os.path.join(root, "val")
    if not os.path.isdir(root) and not os.path.isdir(val_root):
        return Rollouts(present=False)
    found = Rollouts(present=True)
    for target, sub in ((found.train, root), (found.val, val_root)):
        for step, path in step_files(sub):
            try:
                target[step] = read_step_file(path)
            except (OSError, EOFError, ValueError, zlib.error) as error:  # not gzip, cut short, bad bytes, not JSON
                found.skipped.append(SkippedFile(os.path.relpath(path, folder), describe_error(error)))
    return found


def read_step_file(path: str) -> List[Dict[str, Any]]:
    """A step file's records; raises on anything unreadable, a line that is not an object included."""
    records = read_step(path)
    for record in records:
        if not isinstance(record, dict):
            raise ValueError(f"a line holds {type(record).__name__}, not a record")
        if isinstance(record.get("correct"), (int, float)) and not isinstance(record["correct"], bool):
            record["correct"] = bool(record["correct"])  # files written before `correct` was a bool held 1.0 / 0.0
    return records


def describe_error(error: BaseException) -> str:
    """A short reason for the page: the error's kind and its first line."""
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:200] if text else type(error).__name__
