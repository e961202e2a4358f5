"""What do the rollout files and the run report cost a run? (issue 53: at most 2 % of a step, and a
stated size per 100 steps.)

    .venv/bin/python run_pipeline.py --config example_gspo_smollm2.yaml max_steps=6 eval_steps=3 \\
        output_dir=output/smollm2_files
    .venv/bin/python benchmarks/bench_rollout_files.py output/smollm2_files [--steps-per-eval 5]

Reads the run's metrics.jsonl (each step's `time/record_s` beside `time/step_s`, the bytes written
`rollouts/train_bytes` and `rollouts/val_bytes`) and times `write_report` on the run folder; prints
the record phase's share of a step against the 2 % bound, the size per 100 steps (validation every
`--steps-per-eval` steps, the example's 5 by default) and the report's time and size. Exit 1 when
the share is over the bound.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import median  # noqa: E402

SHARE_BOUND = 0.02


def cost_figures(rows: Sequence[Dict[str, Optional[float]]], steps_per_eval: int) -> Dict[str, float]:
    """The record phase's share of a step (median and largest), bytes per step and per validation,
    and MB per 100 steps at one validation every `steps_per_eval` steps."""
    trained = [r for r in rows if r.get("time/record_s") is not None and r.get("time/step_s")]
    if not trained:
        raise ValueError("no step with time/record_s: a run from before the rollout files, or none trained")
    shares = [r["time/record_s"] / r["time/step_s"] for r in trained]
    train_bytes = median(r.get("rollouts/train_bytes") for r in trained) or 0.0
    val_bytes = median(r.get("rollouts/val_bytes") for r in rows) or 0.0
    return {"steps": float(len(trained)), "share_median": median(shares), "share_max": max(shares),
            "record_s_median": median(r["time/record_s"] for r in trained),
            "step_s_median": median(r["time/step_s"] for r in trained),
            "train_bytes_per_step": train_bytes, "val_bytes_per_validation": val_bytes,
            "mb_per_100_steps": (100 * train_bytes + (100 / steps_per_eval) * val_bytes) / 1e6}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run's output_dir")
    parser.add_argument("--steps-per-eval", type=int, default=5)
    args = parser.parse_args(argv)
    path = os.path.join(args.run, "metrics.jsonl")
    if not os.path.isfile(path):
        print(f"error: {args.run} is not a run folder (no metrics.jsonl)", file=sys.stderr)
        return 2
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    try:
        figures = cost_figures(rows, args.steps_per_eval)
    except ValueError as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 2
    from roll_gspo.report import write_report

    start = time.perf_counter()
    page = write_report(args.run, path=os.path.join(args.run, "report.bench.html"))
    report_s, report_bytes = time.perf_counter() - start, os.path.getsize(page)
    os.remove(page)
    print(f"steps {figures['steps']:.0f}: record phase median {figures['record_s_median'] * 1e3:.1f} ms of a "
          f"{figures['step_s_median']:.1f} s step")
    print(f"record share of a step: median {100 * figures['share_median']:.3f} %, largest "
          f"{100 * figures['share_max']:.3f} %   (bound {100 * SHARE_BOUND:.0f} %)")
    print(f"size: {figures['train_bytes_per_step'] / 1e3:.1f} KB a step, {figures['val_bytes_per_validation'] / 1e3:.1f} "
          f"KB a validation -> {figures['mb_per_100_steps']:.2f} MB per 100 steps (validation every "
          f"{args.steps_per_eval})")
    print(f"report: {report_s:.2f} s to write, {report_bytes / 1e6:.2f} MB")
    return 0 if figures["share_max"] <= SHARE_BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
