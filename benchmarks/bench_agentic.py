"""Does the agentic example learn, and fast enough? Runs `run_pipeline.py --config
example_agentic.yaml` (any overrides after the options) with the built-in cache as it is (a warm
cache: the warm-started model already built, as after a first run; `--cold-cache` builds it inside the
timed run), follows its metrics.jsonl while it runs, and reports each validation as

  step, minutes since the command started, val/success_rate

then the rise from the first validation (step 0) to the best one, and whether it reached the target
(+0.20 within 15 minutes) in time. The run is stopped (SIGINT: it finishes its step, saves and
exits) once the time budget is spent. Minutes are wall time on a shared machine: upper bounds.

    .venv/bin/python benchmarks/bench_agentic.py [--minutes 15] [--json out.json] [overrides...]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_RISE = 0.20
TARGET_MINUTES = 15.0
METRIC = "val/success_rate"


def validation_curve(records: List[Dict], minutes_at: Dict[int, float]) -> List[Dict[str, float]]:
    """(step, minutes, success rate) of each validation record, in step order."""
    return [{"step": r["step"], "minutes": minutes_at.get(r["step"], float("nan")), "success_rate": r[METRIC]}
            for r in sorted(records, key=lambda r: r["step"]) if r.get(METRIC) is not None]


def rise(curve: List[Dict[str, float]], budget_minutes: float) -> Dict[str, float]:
    """The first validation, the best one within the budget, and the gain between them; the first
    time (minutes) the gain reached TARGET_RISE, if it did."""
    if len(curve) < 2:
        raise ValueError(f"fewer than two validations ({len(curve)}); is eval_steps > 0, and did the run get past "
                         f"its first eval_steps steps?")
    first = curve[0]
    within = [p for p in curve if p["minutes"] <= budget_minutes] or curve[:1]
    best = max(within, key=lambda p: (p["success_rate"], -p["step"]))
    reached = next((p for p in within if p["success_rate"] - first["success_rate"] >= TARGET_RISE - 1e-9), None)
    return {"start": first["success_rate"], "best": best["success_rate"], "best_step": best["step"],
            "best_minutes": best["minutes"], "gain": best["success_rate"] - first["success_rate"],
            "target_reached_minutes": reached["minutes"] if reached else None,
            "end": within[-1]["success_rate"], "end_step": within[-1]["step"]}


def read_records(path: str) -> List[Dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        lines = handle.read().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="example_agentic.yaml")
    parser.add_argument("--minutes", type=float, default=TARGET_MINUTES, help="time budget; the run is stopped after")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--output-dir", help="keep the run's output here (default: a temporary folder)")
    parser.add_argument("--cold-cache", action="store_true",
                        help="an empty built-in cache: the warm start is built inside the timed run")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="roll_gspo_bench_agentic_") as work:
        env = dict(os.environ)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("TORCH_COMPILE_DISABLE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if args.cold_cache:
            env["ROLL_GSPO_CACHE"] = os.path.join(work, "cache")
        output_dir = args.output_dir or os.path.join(work, "out")
        metrics_path = os.path.join(output_dir, "metrics.jsonl")
        command = [sys.executable, "run_pipeline.py", "--config", args.config, f"output_dir={output_dir}",
                   *args.overrides]
        print("running:", " ".join(command), flush=True)
        load_before = os.getloadavg()
        start = time.perf_counter()
        log = open(os.path.join(work, "run.log"), "w")
        child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        minutes_at: Dict[int, float] = {}
        seen, stopped_at, loads = 0, None, []
        while True:
            code = child.poll()
            records = read_records(metrics_path)
            now = (time.perf_counter() - start) / 60
            for record in records[seen:]:
                minutes_at[record["step"]] = now
                if record.get(METRIC) is not None:
                    print(f"step {record['step']:4d}  {now:6.2f} min  {METRIC} {record[METRIC]:.3f}", flush=True)
            seen = len(records)
            if code is not None:
                break
            if stopped_at is None and now > args.minutes:
                stopped_at = now
                print(f"time budget of {args.minutes:g} min spent: stopping the run (SIGINT)", flush=True)
                child.send_signal(signal.SIGINT)
            loads.append(os.getloadavg()[0])
            time.sleep(2)
        wall = (time.perf_counter() - start) / 60
        log.close()
        if code != 0:
            print(f"the run failed (exit {code}); its last lines:")
            print("".join(open(os.path.join(work, "run.log")).readlines()[-30:]))
            return 1
        curve = validation_curve(read_records(metrics_path), minutes_at)
    figures = rise(curve, args.minutes)
    load = {"load_1min_before": load_before[0], "load_1min_mean_during": sum(loads) / max(len(loads), 1),
            "cpus": os.cpu_count()}
    ok = figures["target_reached_minutes"] is not None
    print("\n== agentic example benchmark ==")
    print(f"command: {' '.join(command[1:])}")
    print(f"wall: {wall:.1f} min{' (stopped at the budget)' if stopped_at else ''}; machine load (1-min average) "
          f"{load['load_1min_before']:.1f} before, {load['load_1min_mean_during']:.1f} on average during, "
          f"{load['cpus']} CPUs: minutes are upper bounds")
    print(f"{METRIC}: step 0 {figures['start']:.3f} -> best {figures['best']:.3f} (step {figures['best_step']}, "
          f"{figures['best_minutes']:.1f} min), gain {figures['gain']:+.3f}; last within budget {figures['end']:.3f} "
          f"(step {figures['end_step']})")
    reached = figures["target_reached_minutes"]
    print(f"target: +{TARGET_RISE:.2f} within {args.minutes:g} min: "
          + (f"PASS (reached at {reached:.1f} min)" if ok else "FAIL"))
    if args.json:
        Path(args.json).write_text(json.dumps({**figures, **load, "wall_minutes": wall, "curve": curve,
                                               "command": command[1:], "pass": ok}, indent=1))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
