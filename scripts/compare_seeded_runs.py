"""Does a change move results? Run the same seeded config on two revisions and compare every step.

    .venv/bin/python scripts/compare_seeded_runs.py --before HEAD~1               # HEAD~1 against the working tree
    .venv/bin/python scripts/compare_seeded_runs.py --before main --after HEAD --steps 5 \\
        --config example_grpo.yaml actor_train.training_args.learning_rate=1e-4

Each revision runs `run_pipeline.py --config CONFIG max_steps=STEPS` (plus the overrides) in a
checkout of its own (`git worktree`, removed afterwards; the working tree itself for `--after
.`) with this environment's Python, into a folder of its own. Then each step's metrics.jsonl
records are compared key by key: wall-clock, memory and stall figures (`time/`, `memory/`, `perf/`,
`throughput/`, `stall/`, `*_s`, `*seconds`, `*_gb`) are skipped, keys one run logs and the other
does not are listed apart (a metric the change added or removed), every other number must agree
within `--tolerance` (absolute; default 0: a seeded run on one machine repeats itself exactly). Prints one line per differing key
(first step, both values, largest gap) and a verdict; exit 0 when nothing moved, 1 when something
did, 2 when a run failed. docs/contributing.md asks for it after any change meant to move nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNSEEDED_PREFIXES = ("time/", "memory/", "perf/", "throughput/", "stall/")
UNSEEDED_SUFFIXES = ("_s", "seconds", "_gb", "_per_s")  # wall-clock and memory figures under other names


@dataclass
class Difference:
    key: str
    first_step: int
    before: Optional[float]
    after: Optional[float]
    largest_gap: float

    def line(self) -> str:
        return (f"{self.key}: step {self.first_step} {self.before!r} -> {self.after!r} "
                f"(largest gap over the run {self.largest_gap:.3g})")


def read_metrics(path: str) -> List[Dict[str, Optional[float]]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def seeded(key: str) -> bool:
    """False for wall-clock, memory and stall figures, which no seed repeats."""
    return key != "step" and not key.startswith(UNSEEDED_PREFIXES) and not key.endswith(UNSEEDED_SUFFIXES)


def keys_of_one_side(before: Sequence[Dict], after: Sequence[Dict]) -> Tuple[List[str], List[str]]:
    """(seeded keys only the first run logs, only the second logs): a metric a change removed or added."""
    old = {k for row in before for k in row if seeded(k)}
    new = {k for row in after for k in row if seeded(k)}
    return sorted(old - new), sorted(new - old)


def compare_metrics(before: Sequence[Dict], after: Sequence[Dict], tolerance: float = 0.0) -> List[Difference]:
    """The seeded keys both runs log whose values differ by more than `tolerance` at some step (a
    step logged by one run only counts), each with its first differing step."""
    by_step_before = {row["step"]: row for row in before}
    by_step_after = {row["step"]: row for row in after}
    removed, added = keys_of_one_side(before, after)
    found: Dict[str, Difference] = {}
    for step in sorted(set(by_step_before) | set(by_step_after)):
        old, new = by_step_before.get(step, {}), by_step_after.get(step, {})
        for key in sorted((set(old) | set(new))):
            if not seeded(key) or key in removed or key in added:
                continue
            a, b = old.get(key), new.get(key)
            gap = _gap(a, b)
            if gap > tolerance:
                if key not in found:
                    found[key] = Difference(key, step, a, b, gap)
                found[key].largest_gap = max(found[key].largest_gap, gap)
    return sorted(found.values(), key=lambda d: (d.first_step, d.key))


def _gap(a: Optional[float], b: Optional[float]) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    return abs(a - b)


def run_revision(revision: str, config: str, steps: int, overrides: Sequence[str], out_dir: str,
                 seed: int, side: str) -> str:
    """Run the config at `revision` ("." = the working tree) into `<out_dir>/<side>`; returns its
    metrics.jsonl. `side` ("before" / "after") keeps the two runs apart even when both are revisions."""
    checkout = REPO
    worktree = None
    if revision != ".":
        worktree = tempfile.mkdtemp(prefix="roll_gspo_compare_")
        subprocess.run(["git", "worktree", "add", "--detach", worktree, revision], cwd=REPO, check=True,
                       capture_output=True, text=True)
        checkout = worktree
    try:
        output_dir = os.path.join(out_dir, side)
        command = [sys.executable, "run_pipeline.py", "--config", config, f"max_steps={steps}", f"seed={seed}",
                   f"output_dir={output_dir}", "eval_steps=0", "save_steps=0", *overrides]
        env = {**os.environ, "PYTHONPATH": checkout + os.pathsep + os.environ.get("PYTHONPATH", "")}
        print(f"[{revision}] {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command, cwd=checkout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"the run at {revision} failed (exit {done.returncode})")
        return os.path.join(output_dir, "metrics.jsonl")
    finally:
        if worktree:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=REPO, capture_output=True)
            shutil.rmtree(worktree, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision of the baseline")
    parser.add_argument("--after", default=".", help="git revision of the change ('.': the working tree)")
    parser.add_argument("--config", default="example_gspo.yaml", help="config name or path")
    parser.add_argument("--steps", type=int, default=3, help="steps each run trains (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=0.0, help="absolute gap allowed per value")
    parser.add_argument("--keep", help="folder for both runs' outputs (default: a temporary one, removed)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    out_dir = args.keep or tempfile.mkdtemp(prefix="roll_gspo_compare_out_")
    try:
        paths = [run_revision(rev, args.config, args.steps, args.overrides, out_dir, args.seed, side)
                 for side, rev in (("before", args.before), ("after", args.after))]
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"error: {getattr(exc, 'stderr', None) or exc}", file=sys.stderr)
        return 2
    before, after = (read_metrics(path) for path in paths)
    differences = compare_metrics(before, after, args.tolerance)
    for difference in differences:
        print(difference.line())
    removed, added = keys_of_one_side(before, after)
    for label, keys_listed in (("only before", removed), ("only after", added)):
        if keys_listed:
            print(f"{label} (not compared): {', '.join(keys_listed)}")
    keys = len({k for row in before for k in row if seeded(k)} - set(removed))
    verdict = "moved" if differences else "unchanged"
    print(f"{verdict}: {len(differences)} of {keys} seeded keys differ over {len(before)} / {len(after)} steps "
          f"({args.before} -> {args.after}, {args.config}, tolerance {args.tolerance:g})")
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
