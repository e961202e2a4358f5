"""Does the out-of-the-box job learn, and fast enough? Runs exactly what `make run` runs
(`run_pipeline.py --config example_gspo.yaml`) with an empty built-in cache, so the tiny model is
built and SFT-warm-started inside the timed run, then reports:

  - wall time of the whole command (target: <= 600 s on a 2-core CPU machine),
  - validation accuracy at step 0 and at the end, and the rise (target: >= 0.30 absolute).

    .venv/bin/python benchmarks/bench_example.py [--config example_gspo.yaml] [--json out.json] [overrides...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 600.0
TARGET_RISE = 0.30


def accuracy_rise(records: List[Dict]) -> Dict[str, float]:
    """First and last `val/accuracy` of a metrics.jsonl, and their difference."""
    val = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    if len(val) < 2:
        raise ValueError("metrics hold fewer than two validation points; is eval_steps > 0?")
    (first_step, first), (last_step, last) = min(val), max(val)
    return {"val_first_step": first_step, "val_first": first, "val_last_step": last_step, "val_last": last,
            "val_rise": last - first}


def verdicts(figures: Dict[str, float]) -> Dict[str, bool]:
    return {"time": figures["wall_seconds"] <= TARGET_SECONDS, "learning": figures["val_rise"] >= TARGET_RISE}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="example_gspo.yaml")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--keep-cache", action="store_true",
                        help="reuse ~/.cache/roll_gspo (skips the warm start) instead of an empty cache")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="roll_gspo_bench_") as work:
        env = dict(os.environ)
        if not args.keep_cache:
            env["ROLL_GSPO_CACHE"] = os.path.join(work, "cache")
        output_dir = os.path.join(work, "out")
        command = [sys.executable, "run_pipeline.py", "--config", args.config, f"output_dir={output_dir}",
                   *args.overrides]
        print("running:", " ".join(command), flush=True)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO_ROOT, env=env)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(f"the run failed (exit {done.returncode})")
            return 1
        with open(os.path.join(output_dir, "metrics.jsonl")) as handle:
            records = [json.loads(line) for line in handle]
    figures = {"wall_seconds": wall, **accuracy_rise(records)}
    ok = verdicts(figures)
    print("\n== example benchmark ==")
    print(f"whole command (warm start {'skipped' if args.keep_cache else 'included'}): {wall:7.1f} s   "
          f"target <= {TARGET_SECONDS:.0f} s  {'PASS' if ok['time'] else 'FAIL'}")
    print(f"validation accuracy: step {figures['val_first_step']} {figures['val_first']:.3f} -> step "
          f"{figures['val_last_step']} {figures['val_last']:.3f}, rise {figures['val_rise']:+.3f}   "
          f"target >= +{TARGET_RISE:.2f}  {'PASS' if ok['learning'] else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps({**figures, "pass": ok}, indent=1))
    return 0 if all(ok.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
