"""Rollout files: what the model said, every step (docs/rollouts.md). One gzip'd JSON-lines file per
step, `step_000012.jsonl.gz`, in `rollout_dump_dir` (training samples) and `validation_data_dir`
(every validation prompt); one JSON object per sample. Averages hide reward hacking, format collapse
and truncation; the samples show them.

A file is written whole under a temporary name and renamed, so a crash leaves no half file, and a
step that runs again after a resume replaces its file: no step is written twice or lost.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

STEP_FILE = "step_{:06d}.jsonl.gz"
_STEP_NAME = re.compile(r"step_(\d+)\.jsonl\.gz")


def step_file(folder: str, step: int) -> str:
    return os.path.join(folder, STEP_FILE.format(step))


def write_step(folder: str, step: int, records: Sequence[Dict[str, Any]]) -> Tuple[str, int]:
    """`records` as `folder`/step_<N>.jsonl.gz, replacing one a run wrote before (a resumed step);
    returns the path and its size in bytes. The same records give the same bytes: the gzip header
    holds no file name (the temporary one carries the pid, whose digit count changed the size) and
    no time, so a resumed run's files and sizes (`rollouts/*_bytes`) equal an uninterrupted run's."""
    os.makedirs(folder, exist_ok=True)
    path = step_file(folder, step)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", compresslevel=6, fileobj=raw,
                                                   mtime=0) as packed:
        for record in records:
            packed.write(json.dumps(record, ensure_ascii=False, allow_nan=False, default=_plain).encode("utf-8"))
            packed.write(b"\n")
    os.replace(partial, path)
    return path, os.path.getsize(path)


def _plain(value: Any) -> Any:
    """numpy / torch scalars and other numbers as plain JSON values."""
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


def step_files(folder: str) -> List[Tuple[int, str]]:
    """(step, path) of the step files in `folder`, by step."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), os.path.join(folder, name)) for name in os.listdir(folder)
             if (m := _STEP_NAME.fullmatch(name))]
    return sorted(found)


def read_step(path: str) -> List[Dict[str, Any]]:
    """The records of one step file (raises on a corrupt one: the caller decides to skip it)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def iter_records(folder: str) -> Iterator[Dict[str, Any]]:
    for _, path in step_files(folder):
        yield from read_step(path)


class RolloutWriter:
    """Writes each step's records to `train_dir`, each validation's to `val_dir` (None: not
    written). What it costs in time is the step's `record` phase (the loop times it)."""

    def __init__(self, train_dir: Optional[str], val_dir: Optional[str]):
        self.train_dir, self.val_dir = train_dir, val_dir

    def write(self, kind: str, step: int, records: Sequence[Dict[str, Any]]) -> Dict[str, float]:
        """`kind` "train" or "val"; returns `rollouts/<kind>_bytes` and `rollouts/<kind>_samples`
        (empty when that kind is not written)."""
        folder = self.train_dir if kind == "train" else self.val_dir
        if folder is None or not records:
            return {}
        _, size = write_step(folder, step, records)
        return {f"rollouts/{kind}_bytes": float(size), f"rollouts/{kind}_samples": float(len(records))}
