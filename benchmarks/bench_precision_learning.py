"""Does a bf16 run learn like an fp32 one at equal steps, with and without the rollout correction?

Runs one example several times, one run at a time (each its own `run_pipeline.py` process and Ray),
in *arms* that differ only in precision and correction:

* ``fp32``: trainer and vLLM in fp32, no correction (old log-probs from vLLM where `auto` finds
  them exact);
* ``bf16``: trainer and vLLM in bf16 (DeepSpeed: bf16 weights on fp32 master weights), no
  correction (old log-probs from the trainer's pass: `auto` outside fp32);
* ``bf16_corrected``: bf16 with `train_infer_correction.is_weight` (geometric, truncated at 1.2:
  examples/example_gspo_smollm2.yaml's), weighting each response by pi_trainer / pi_vllm;
* ``fp32_corrected`` (not run by default): the correction in fp32, where its weights stay ~1.

Each arm runs for every ``--seeds`` value; every run takes the same number of steps and validates at
the same steps. Printed side by side: the validation accuracy per step (each seed, and the mean
over seeds), and per arm the mean trainer-vs-vLLM log-prob gap (`rollout/logprob_gap`), the largest
correction weight and the median step time; written to ``<out>/precision_learning.json``.

    .venv/bin/python benchmarks/bench_precision_learning.py                    # the tiny example
    .venv/bin/python benchmarks/bench_precision_learning.py --config examples/example_gspo_smollm2.yaml \\
        --steps 20 --eval-steps 5                                              # SmolLM2-135M
    .venv/bin/python benchmarks/bench_precision_learning.py --smoke            # 2 small steps, 1 seed

Durations (2-core machine, quiet; loaded runs take longer): the tiny example (example_gspo.yaml,
40 steps, validation every 10) is ~2-5 minutes a run after its first start, so the default 3 arms x 2
seeds take about 20-30 minutes. SmolLM2 at 20 steps with validation every 5 (600 held-out prompts,
~1-2 minutes each) is ~20 minutes a bf16 run and ~30 an fp32 one: about 2.5 hours for 3 arms x 2
seeds. Extra ``key=value`` arguments go to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_peers import dtype_overrides  # noqa: E402  (needs REPO_ROOT on sys.path)

CORRECTION = ["train_infer_correction.is_weight.enabled=true", "train_infer_correction.is_weight.weight_type=geometric",
              "train_infer_correction.is_weight.upper_bound=1.2"]
NO_CORRECTION = ["train_infer_correction.is_weight.enabled=false"]
ARMS: Dict[str, List[str]] = {
    "fp32": dtype_overrides("fp32") + NO_CORRECTION,
    "bf16": dtype_overrides("bf16") + NO_CORRECTION,
    "bf16_corrected": dtype_overrides("bf16") + CORRECTION,
    "fp32_corrected": dtype_overrides("fp32") + CORRECTION,
}
DEFAULT_ARMS = ("fp32", "bf16", "bf16_corrected")
# Wiring only: 2 small steps, validation at 0 and 2 on a few prompts, one seed.
SMOKE_OVERRIDES = ["rollout_batch_size=4", "num_return_sequences_in_group=4",
                   "actor_train.training_args.per_device_train_batch_size=2",
                   "actor_train.training_args.gradient_accumulation_steps=1", "validation.data_args.max_samples=16"]
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="example_gspo.yaml", help="the example (default: %(default)s)")
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=sorted(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, help="max_steps of every run (default: the config's)")
    parser.add_argument("--eval-steps", type=int, help="eval_steps of every run (default: the config's)")
    parser.add_argument("--out", default="output/bench_precision_learning",
                        help="folder of the runs and precision_learning.json (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 small steps, validation at steps 0 and 2 on 16 prompts, the first seed only")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_steps, args.seeds = 2, 2, args.seeds[:1]
    return args


def run_overrides(args: argparse.Namespace, arm: str, seed: int, output_dir: Path) -> List[str]:
    """The run's overrides: its output folder and seed, the arm's precision and correction, the
    common steps, then the caller's."""
    common = [f"output_dir={output_dir}", f"seed={seed}", "track_with=none", "save_steps=0"]
    if args.steps is not None:
        common.append(f"max_steps={args.steps}")
    if args.eval_steps is not None:
        common.append(f"eval_steps={args.eval_steps}")
    return common + ARMS[arm] + (SMOKE_OVERRIDES if args.smoke else []) + list(args.overrides)


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise_run(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A run's validation curve ({step: val/accuracy}) and its means over the training steps."""
    curve = {r["step"]: r["val/accuracy"] for r in records if r.get("val/accuracy") is not None}
    steps = [r for r in records if "actor/pg_loss" in r]

    def mean(key: str) -> Optional[float]:
        values = [r[key] for r in steps if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    weights = [r["rollout_correction/weight_max"] for r in steps if r.get("rollout_correction/weight_max") is not None]
    times = sorted(r["time/step_s"] for r in steps if r.get("time/step_s") is not None)
    return {"curve": curve, "steps": len(steps), "logprob_gap": mean("rollout/logprob_gap"),
            "old_logprobs_from_rollout": mean("rollout/old_logprobs_from_rollout"),
            "reward": mean("reward/mean"), "weight_max": max(weights) if weights else None,
            "median_step_s": times[len(times) // 2] if times else None}


def format_report(runs: Dict[str, Dict[int, Dict[str, Any]]]) -> str:
    """The curves side by side (a column per arm and seed, and each arm's mean over its seeds),
    then one line per arm."""
    arms = list(runs)
    steps = sorted({s for by_seed in runs.values() for run in by_seed.values() for s in run["curve"]})
    columns = [(arm, seed) for arm in arms for seed in runs[arm]] + [(arm, None) for arm in arms]
    names = [f"{arm} s{seed}" if seed is not None else f"{arm} mean" for arm, seed in columns]
    width = max(10, *(len(n) for n in names)) + 2
    lines = ["validation accuracy at equal steps (greedy, held-out)",
             f"{'step':>6}" + "".join(n.rjust(width) for n in names)]
    for step in steps:
        cells = []
        for arm, seed in columns:
            values = ([runs[arm][seed]["curve"].get(step)] if seed is not None
                      else [run["curve"].get(step) for run in runs[arm].values()])
            values = [v for v in values if v is not None]
            cells.append(f"{sum(values) / len(values):.3f}".rjust(width) if values else "-".rjust(width))
        lines.append(f"{step:>6}" + "".join(cells))
    lines += ["", f"{'arm':<16}{'rise (mean)':>12}{'logprob gap':>13}{'old lp from vLLM':>18}{'weight max':>12}"
                  f"{'reward':>9}{'step s':>9}"]
    for arm in arms:
        by_seed = list(runs[arm].values())
        rises = [run["curve"][max(run["curve"])] - run["curve"][min(run["curve"])] for run in by_seed
                 if len(run["curve"]) >= 2]

        def avg(key: str) -> Optional[float]:
            values = [run[key] for run in by_seed if run[key] is not None]
            return sum(values) / len(values) if values else None

        def show(value: Optional[float], spec: str) -> str:
            return "-" if value is None else format(value, spec)

        rise = sum(rises) / len(rises) if rises else None
        weights = [run["weight_max"] for run in by_seed if run["weight_max"] is not None]
        lines.append(f"{arm:<16}{show(rise, '+.3f'):>12}{show(avg('logprob_gap'), '.2e'):>13}"
                     f"{show(avg('old_logprobs_from_rollout'), '.2f'):>18}{show(max(weights) if weights else None, '.3f'):>12}"
                     f"{show(avg('reward'), '.3f'):>9}{show(avg('median_step_s'), '.2f'):>9}")
    lines.append("rise: last minus first validation, mean over seeds. logprob gap: mean |trainer - vLLM| per token "
                 "over the steps. old lp from vLLM: the fraction of steps whose old log-probs were vLLM's.")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(REPO_ROOT)}
    runs: Dict[str, Dict[int, Dict[str, Any]]] = {}
    failed = []
    for seed in args.seeds:  # seed by seed: a partial result already has every arm of the first seed
        for arm in args.arms:
            run_dir = out / f"{arm}_s{seed}"
            command = [sys.executable, "run_pipeline.py", "--config", args.config,
                       *run_overrides(args, arm, seed, run_dir)]
            print(f"[bench] {arm} seed {seed}: {' '.join(command[2:])}", flush=True)
            start = time.monotonic()
            with open(out / f"{arm}_s{seed}.log", "w") as log:
                done = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            summary = summarise_run(read_metrics(run_dir / "metrics.jsonl"))
            summary["wall_s"] = time.monotonic() - start
            print(f"[bench] {arm} seed {seed}: exit {done.returncode}, {summary['steps']} steps in "
                  f"{summary['wall_s'] / 60:.1f} min, validation {summary['curve']}", flush=True)
            if done.returncode != 0:
                failed.append(f"{arm} seed {seed} (see {out / f'{arm}_s{seed}.log'})")
            runs.setdefault(arm, {})[seed] = summary
    print()
    print(format_report(runs))
    report = {"config": args.config, "arms": {arm: ARMS[arm] for arm in args.arms}, "seeds": args.seeds,
              "steps": args.steps, "eval_steps": args.eval_steps, "overrides": args.overrides, "smoke": args.smoke,
              "runs": {arm: {str(seed): run for seed, run in by_seed.items()} for arm, by_seed in runs.items()}}
    (out / "precision_learning.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'precision_learning.json'}")
    if failed:
        print("failed runs: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
