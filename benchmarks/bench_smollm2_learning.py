"""Does GSPO improve a real pretrained model on real tasks within 45 minutes on this machine?

Runs examples/example_gspo_smollm2.yaml (SmolLM2-135M-Instruct on a mix of reasoning-gym tasks)
for a wall-clock budget (start-up and any warm start included), then stops it gracefully (SIGTERM:
the step in progress finishes) and reads its metrics.jsonl: the held-out greedy accuracy per task
and averaged over the tasks at step 0 and at each validation (`eval_steps`), the rewarded format's
rate beside it. The answer is read without needing the format
(roll_gspo.rewards.answers.extract_answer), so a format change alone does not move accuracy.

Goal (issue 54): the task-averaged accuracy rises by >= +0.25 absolute within the budget, every task
ends above its step-0 accuracy, and no task's most common reply answer is given more than twice as
often as it occurs among the gold answers (read from the last validation's replies,
`<run>/rollouts/val/`): a policy that collapsed onto a task's frequent answer (gcd "1", yes/no "Yes")
gains accuracy without solving anything. After the run (outside the budget) the base and the final
model's pass@1 / pass@k at the rollout temperature are measured with `python -m roll_gspo.eval`
(`--passk-prompts` held-out prompts a task, `--passk-n` replies; 0 skips it) and printed beside the
curve. A run stopped by the budget has no final_model/: its last checkpoint is evaluated, a LoRA
run's with the adapter merged onto the base model by the config's actor_train.model_args (the run's
overrides are given to the evaluation too, so LoRA keys on this command line count). Prints the curve and the goal side by side, writes `<out>/learning.json` and
`<out>/learning.png`.

    .venv/bin/python benchmarks/bench_smollm2_learning.py                      # 45 minutes
    .venv/bin/python benchmarks/bench_smollm2_learning.py --minutes 10 seed=7  # overrides go to the run
    .venv/bin/python benchmarks/bench_smollm2_learning.py --smoke              # 2 small steps, no verdict
    .venv/bin/python benchmarks/bench_smollm2_learning.py --table DIR1 DIR2 ...  # finished runs side by side

`--table` compares finished runs (each an `--out` folder): per validation point the mean accuracy,
and over the training steps since the previous point the clip fraction, entropy and reply length;
pass@k of the run's final model where `<out>/eval.json` holds the evaluation command's result
(`python -m roll_gspo.eval --model <out>/run --config <yaml> --n 8 --out <out>/eval.json`; the
benchmark writes it itself unless `--passk-n 0`). Then a second table, one row per config: the runs
of one method over seeds, their mean accuracy at each validation step with each run's beside it.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import validation_tasks  # noqa: E402  (needs REPO_ROOT on sys.path)

CONFIG = "examples/example_gspo_smollm2.yaml"
GOAL_RISE = 0.25
# A task's most common reply answer may be given at most this many times as often as it is a gold answer.
MAX_ANSWER_SHARE_RATIO = 2.0
# A couple of small steps and a small validation: the wiring, not the learning.
SMOKE_OVERRIDES = ["max_steps=2", "eval_steps=2", "rollout_batch_size=4", "num_return_sequences_in_group=4",
                   "response_length=48", "validation.generating_args.max_new_tokens=48",
                   "actor_train.training_args.per_device_train_batch_size=2",
                   "actor_train.training_args.gradient_accumulation_steps=2",  # 2 optimizer steps a rollout
                   "actor_infer.strategy_args.strategy_config.max_model_len=144"]
SMOKE_VAL_SIZE = 8


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=CONFIG, help="the run's YAML (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=45.0,
                        help="wall-clock budget of the run, start-up included (default: %(default)s)")
    parser.add_argument("--out", default="output/bench_smollm2_learning",
                        help="folder of the run, learning.json and learning.png (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 small steps and 8 held-out prompts per task: checks the wiring, no verdict")
    parser.add_argument("--passk-n", type=int, default=8,
                        help="after the run: replies per prompt for the base and final models' pass@k at the "
                             "rollout temperature (0: skip; default: %(default)s)")
    parser.add_argument("--passk-prompts", type=int, default=50,
                        help="held-out prompts a task for that pass@k (default: %(default)s)")
    parser.add_argument("--table", action="store_true",
                        help="no run: print a markdown table comparing the finished runs whose --out folders "
                             "are given as arguments")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the run (with --table: the folders)")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    if args.passk_n < 0 or args.passk_prompts < 1:
        parser.error("--passk-n must be >= 0 (0: no pass@k) and --passk-prompts >= 1")
    return args


def task_keys(records: List[Dict]) -> List[str]:
    """The tasks of a run: every `val/<task>/accuracy` key."""
    return validation_tasks(records)


def learning_curve(records: List[Dict], elapsed: Optional[Dict[int, float]] = None) -> List[Dict]:
    """One point per validation: step, elapsed seconds (when known), per-task greedy accuracy and
    format rate, and their means over the tasks (each task weighs the same)."""
    tasks = task_keys(records)
    points = []
    for record in records:
        if not tasks or f"val/{tasks[0]}/accuracy" not in record:
            continue
        accuracy = {t: record.get(f"val/{t}/accuracy") for t in tasks}
        fmt = {t: record.get(f"val/{t}/format_rate") for t in tasks}
        point = {"step": record["step"], "elapsed_s": (elapsed or {}).get(record["step"]),
                 "accuracy": accuracy, "format_rate": fmt, "mean_accuracy": _mean(accuracy.values()),
                 "top_answer_share": {t: record.get(f"val/{t}/top_answer_share") for t in tasks},
                 "constant_answer_accuracy": {t: record.get(f"val/{t}/constant_answer_accuracy") for t in tasks},
                 "mean_format_rate": _mean(fmt.values())}
        points.append(point)
    return sorted(points, key=lambda p: p["step"])


def answer_shares(records: List[Dict]) -> Dict[str, Dict]:
    """Per task, from one validation's reply records (roll_gspo.metrics.rollouts): the most common
    extracted answer, its share of the replies and its share of the gold answers."""
    from roll_gspo.tasks.sample_metrics import reference_answer

    by_task: Dict[str, List[Dict]] = {}
    for record in records:
        by_task.setdefault(record["task"], []).append(record)
    out = {}
    for task, rows in sorted(by_task.items()):
        answers = Counter(str(r.get("answer")) for r in rows)
        top, count = answers.most_common(1)[0]
        gold = [reference_answer(r["ground_truth"]) for r in rows]
        out[task] = {"answer": top, "reply_share": count / len(rows), "gold_share": gold.count(top) / len(rows)}
    return out


def verdict(curve: List[Dict], goal_rise: float = GOAL_RISE, shares: Optional[Dict[str, Dict]] = None) -> Dict:
    """The goal against the curve's first (step 0) and last points: the mean accuracy's rise, each
    task's change, and whether the rise meets the goal with every task above its start and no task's
    most common answer (`shares`: answer_shares of the last validation) given more than
    MAX_ANSWER_SHARE_RATIO times its gold share."""
    if len(curve) < 2:
        return {"rise": None, "task_change": {}, "rise_ok": False, "every_task_rises": False, "answer_spread_ok": {},
                "pass": False}
    first, last = curve[0], curve[-1]
    change = {t: last["accuracy"][t] - first["accuracy"][t] for t in first["accuracy"]}
    rise = last["mean_accuracy"] - first["mean_accuracy"]
    ok_rise, ok_tasks = rise >= goal_rise, all(c > 0 for c in change.values())
    spread = {t: v["reply_share"] <= MAX_ANSWER_SHARE_RATIO * v["gold_share"] for t, v in (shares or {}).items()}
    return {"rise": rise, "task_change": change, "rise_ok": ok_rise, "every_task_rises": ok_tasks,
            "answer_spread_ok": spread, "answer_shares": shares or {},
            "pass": ok_rise and ok_tasks and bool(spread) and all(spread.values()),
            "first_step": first["step"], "last_step": last["step"]}


def format_report(curve: List[Dict], result: Dict, goal_rise: float = GOAL_RISE) -> str:
    """The curve (accuracy / format per task and their means) and the goal beside the figures."""
    if not curve:
        return "no validation point in the run's metrics"
    tasks = list(curve[0]["accuracy"])
    width = max(8, *(len(t) for t in tasks))
    head = ["step", "min"] + [t.rjust(width) for t in tasks] + ["mean".rjust(width)]
    lines = ["held-out greedy accuracy (format rate)", "  ".join(head)]
    for p in curve:
        minutes = "-" if p["elapsed_s"] is None else f"{p['elapsed_s'] / 60:.1f}"
        cells = [f"{p['accuracy'][t]:.3f} ({p['format_rate'][t] or 0:.2f})".rjust(width) for t in tasks]
        cells.append(f"{p['mean_accuracy']:.3f} ({p['mean_format_rate'] or 0:.2f})".rjust(width))
        lines.append("  ".join([str(p["step"]).rjust(4), minutes.rjust(5)] + cells))
    if result["rise"] is None:
        lines.append("fewer than two validation points: no verdict")
        return "\n".join(lines)
    lines.append("")
    lines.append(f"{'figure':<34}{'measured':>10}   goal")
    lines.append(f"{'mean accuracy rise':<34}{result['rise']:>+10.3f}   >= +{goal_rise:.2f}  "
                 f"{'PASS' if result['rise_ok'] else 'FAIL'}")
    for t, c in result["task_change"].items():
        lines.append(f"{'  ' + t + ' change':<34}{c:>+10.3f}   > 0  {'ok' if c > 0 else 'NO RISE'}")
    for t, ok in result.get("answer_spread_ok", {}).items():
        share = result["answer_shares"][t]
        lines.append(f"{'  ' + t + ' top answer ' + repr(share['answer'])[:12]:<34}{share['reply_share']:>10.3f}   "
                     f"<= {MAX_ANSWER_SHARE_RATIO:g} x gold {share['gold_share']:.3f}  {'ok' if ok else 'NO'}")
    if not result.get("answer_spread_ok"):
        lines.append(f"{'  answer shares':<34}{'-':>10}   no validation replies found: FAIL")
    lines.append(f"{'verdict (step %d -> %d)' % (result['first_step'], result['last_step']):<34}"
                 f"{'PASS' if result['pass'] else 'FAIL':>10}")
    return "\n".join(lines)


def plot(curve: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    x_minutes = all(p["elapsed_s"] is not None for p in curve)
    xs = [p["elapsed_s"] / 60 if x_minutes else p["step"] for p in curve]
    for task in curve[0]["accuracy"]:
        ax.plot(xs, [p["accuracy"][task] for p in curve], marker="o", lw=1, label=task)
    ax.plot(xs, [p["mean_accuracy"] for p in curve], marker="s", lw=2.5, color="black", label="mean")
    ax.plot(xs, [p["mean_format_rate"] for p in curve], ls="--", color="gray", label="format rate (mean)")
    ax.axhline(curve[0]["mean_accuracy"] + GOAL_RISE, color="red", ls=":", lw=1, label="goal: start + 0.25")
    ax.set_xlabel("minutes since start" if x_minutes else "step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("GSPO on SmolLM2-135M-Instruct, reasoning-gym tasks (2-core CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    run_dir = out / "run"
    overrides = [f"output_dir={run_dir}", "save_steps=0", *args.overrides]
    if args.smoke:
        from roll_gspo.config import load_config

        # the loaded config's tasks: a YAML may take them from its `defaults` (the LoRA example)
        tasks = load_config(str(REPO_ROOT / args.config)).tasks or {}
        overrides = SMOKE_OVERRIDES + [f"tasks.{t}.val_size={SMOKE_VAL_SIZE}" for t in tasks] + overrides
    command = [sys.executable, "run_pipeline.py", "--config", args.config, *overrides]
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()  # a previous run's lines are not this run's
    print("running:", " ".join(command), flush=True)
    start = time.monotonic()
    budget = args.minutes * 60
    elapsed: Dict[int, float] = {}  # step -> seconds since start when its validation line appeared
    stopped = False
    with open(out / "run.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(2)
            now = time.monotonic() - start
            for record in _read(metrics_path):
                if any(k.startswith("val/") for k in record) and record["step"] not in elapsed:
                    elapsed[record["step"]] = now
                    print(f"  {now / 60:5.1f} min  step {record['step']}: val/accuracy "
                          f"{record.get('val/accuracy', float('nan')):.3f}", flush=True)
            if now > budget and not stopped:
                print(f"budget of {args.minutes:g} min reached: stopping the run (the step in progress "
                      f"finishes)", flush=True)
                proc.send_signal(signal.SIGTERM)
                stopped = True
    wall = time.monotonic() - start
    records = _read(metrics_path)
    if proc.returncode != 0:
        print(f"the run failed (exit {proc.returncode}); see {out / 'run.log'}")
        return 1
    curve = learning_curve(records, elapsed)
    result = verdict(curve, shares=last_validation_shares(run_dir))
    print()
    print(format_report(curve, result))
    steps = [r for r in records if "time/step_s" in r]
    passk = {} if args.smoke or args.passk_n < 1 else measure_passk(args, run_dir, out)
    if passk:
        print("\n" + format_passk(passk))
    report = {"config": args.config, "overrides": overrides, "minutes": args.minutes, "wall_s": wall,
              "steps": len(steps), "median_step_s": _median([r["time/step_s"] for r in steps]),
              "curve": curve, "goal": {"rise": GOAL_RISE, "every_task_rises": True,
                                       "max_answer_share_ratio": MAX_ANSWER_SHARE_RATIO},
              "result": result, "passk": passk, "smoke": args.smoke}
    (out / "learning.json").write_text(json.dumps(report, indent=1))
    if len(curve) >= 1:
        plot(curve, str(out / "learning.png"))
    print(f"\n{len(steps)} steps in {wall / 60:.1f} min (median step {report['median_step_s'] or 0:.1f} s); "
          f"wrote {out / 'learning.json'} and {out / 'learning.png'}")
    return 0 if (args.smoke or result["pass"]) else 2


def last_validation_shares(run_dir: Path) -> Dict[str, Dict]:
    """answer_shares of the run's last validation replies (`<run>/rollouts/val/`); {} when none."""
    from roll_gspo.metrics.rollouts import read_step, step_files

    files = step_files(str(run_dir / "rollouts" / "val"))
    return answer_shares(read_step(files[-1][1])) if files else {}


def measure_passk(args: argparse.Namespace, run_dir: Path, out: Path) -> Dict[str, Dict]:
    """pass@1 .. pass@n of the base model and of the run's final model at the rollout temperature,
    on the first `--passk-prompts` held-out prompts a task (`python -m roll_gspo.eval`; the base
    model's result is kept in `<out>/eval_base.json` and reused). {name: the eval's `all` figures}."""
    from roll_gspo.config import load_config

    cfg = load_config(str(REPO_ROOT / args.config), args.overrides)
    common = ["--config", args.config, "--val-size", str(args.passk_prompts), "--n", str(args.passk_n),
              "--temperature", str(cfg.actor_infer.generating_args.temperature), *args.overrides]
    results = {}
    for name, model in (("base", cfg.pretrain), ("final", str(run_dir))):
        path = out / ("eval_base.json" if name == "base" else "eval.json")
        if name == "final" or not path.exists():
            done = subprocess.run([sys.executable, "-m", "roll_gspo.eval", "--model", model, "--out", str(path), *common],
                                  cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                print(f"pass@k of the {name} model failed (exit {done.returncode}): python -m roll_gspo.eval "
                      f"--model {model} {' '.join(common)}")
                continue
        results[name] = json.loads(path.read_text())["all"]
    return results


def format_passk(passk: Dict[str, Dict]) -> str:
    """The base and final models' greedy accuracy and pass@k side by side."""
    keys = ["greedy_accuracy"] + sorted((k for k in next(iter(passk.values())) if k.startswith("pass@")),
                                        key=lambda k: int(k.split("@")[1]))
    lines = ["model   " + "  ".join(k.rjust(15) for k in keys)]
    for name, figures in passk.items():
        lines.append(f"{name:<8}" + "  ".join(("-" if figures.get(k) is None else f"{figures[k]:.3f}").rjust(15)
                                             for k in keys))
    return "\n".join(lines)


# Training metrics averaged between validation points in the comparison table: column -> (metric, format).
TABLE_SERIES = {"clip": ("actor/clipfrac", ".3f"), "entropy": ("actor/entropy", ".3f"),
                "reply tokens": ("response/length_mean", ".1f")}


def run_summary(out: Path) -> Dict:
    """One finished run (an `--out` folder) for the comparison table: its curve from learning.json,
    each point with the TABLE_SERIES metrics averaged over the training steps since the previous
    point (step 0: the first step's), and pass@k / greedy accuracy of its final model when
    `<out>/eval.json` exists."""
    learning = json.loads((out / "learning.json").read_text())
    trained = [r for r in _read(out / "run" / "metrics.jsonl") if "time/step_s" in r]
    points, previous = [], 0
    for point in learning["curve"]:
        window = [r for r in trained if previous < r["step"] <= point["step"]] or \
                 [r for r in trained if r["step"] == 1]
        series = {name: _mean(r.get(key) for r in window) for name, (key, _) in TABLE_SERIES.items()}
        points.append({"step": point["step"], "minutes": (point["elapsed_s"] or 0) / 60,
                       "accuracy": point["mean_accuracy"], **series})
        previous = point["step"]
    evaluation = None
    if (out / "eval.json").exists():
        result = json.loads((out / "eval.json").read_text())
        evaluation = {k: v for k, v in result["all"].items() if k.startswith("pass@") or k == "greedy_accuracy"}
    return {"name": out.name, "config": learning["config"], "rise": learning["result"]["rise"], "points": points,
            "eval": evaluation}


def format_table(summaries: List[Dict]) -> str:
    """Markdown: one row per (run, validation point); the final model's pass@k in the run's last row."""
    ks = sorted({k for s in summaries for k in (s["eval"] or {}) if k.startswith("pass@")},
                key=lambda k: int(k.split("@")[1]))
    head = ["run", "step", "min", "mean accuracy", *TABLE_SERIES, *(f"final {k}" for k in ks)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for summary in summaries:
        for i, p in enumerate(summary["points"]):
            last = i == len(summary["points"]) - 1
            cells = [summary["name"] if i == 0 else "", str(p["step"]), f"{p['minutes']:.1f}", f"{p['accuracy']:.3f}"]
            cells += ["-" if p[name] is None else format(p[name], spec) for name, (_, spec) in TABLE_SERIES.items()]
            cells += [f"{summary['eval'][k]:.3f}" if last and summary["eval"] and k in summary["eval"] else ""
                      for k in ks]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_seed_table(summaries: List[Dict]) -> str:
    """Markdown: one row per config (the runs of one method over seeds): at each validation step the
    mean accuracy over its runs with each run's in brackets (in the order given), the rise, and
    the final models' pass@1 / pass@8 where every run has them."""
    groups: Dict[str, List[Dict]] = {}
    for summary in summaries:
        groups.setdefault(summary["config"], []).append(summary)
    steps = sorted({p["step"] for s in summaries for p in s["points"]})

    def cell(values: List[Optional[float]]) -> str:
        if any(v is None for v in values):
            return "-"
        return f"{sum(values) / len(values):.3f}" + (f" ({', '.join(f'{v:.3f}' for v in values)})"
                                                     if len(values) > 1 else "")

    head = ["config", "runs", *(f"step {s}" for s in steps), "rise", "final pass@1", "final pass@8"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config, runs in groups.items():
        by_step = [{p["step"]: p["accuracy"] for p in run["points"]} for run in runs]
        cells = [Path(config).stem, ", ".join(run["name"] for run in runs)]
        cells += [cell([acc.get(step) for acc in by_step]) for step in steps]
        cells.append(cell([run["rise"] for run in runs]))
        cells += [cell([(run["eval"] or {}).get(k) for run in runs]) for k in ("pass@1", "pass@8")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _read(path: Path) -> List[Dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return records


def _median(values) -> Optional[float]:
    values = sorted(values)
    return values[len(values) // 2] if values else None


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.table:
        finished = [run_summary(Path(folder)) for folder in arguments.overrides]
        print(format_table(finished) + "\n\nBy config, over its runs (seeds):\n\n" + format_seed_table(finished))
        sys.exit(0)
    sys.exit(run(arguments))
