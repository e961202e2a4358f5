"""GSPO vs GRPO vs GRPO + Routing Replay, on the built-in dense and MoE models, several seeds.

    .venv/bin/python benchmarks/study_gspo_vs_grpo.py                 # default size (see --help)
    .venv/bin/python benchmarks/study_gspo_vs_grpo.py --smoke         # ~1-2 min check (MoE arms only)
    .venv/bin/python benchmarks/study_gspo_vs_grpo.py --seeds 0 1 --max-steps 20 --out ./output/study

Arms (the examples' settings, nothing tuned per arm):
  gspo         examples/example_gspo.yaml: importance_sampling seq, clip 3e-3 / 4e-3 (the paper's
               3e-4 / 4e-4 scaled as the example explains), seq-mean-token-mean
  grpo         examples/example_grpo.yaml: importance_sampling token, clip 0.2 / 0.28, token-mean
  grpo_replay  grpo + router_replay: true (MoE only; on a dense model there is nothing to replay)

Writes <out>/runs.jsonl (every step of every run), <out>/summary.json, <out>/table.md and
<out>/study.png (training reward, validation accuracy, clip fraction, expert volatility, gradient
norm, trainer-vs-rollout log-prob gap; mean over seeds per model and arm), then prints the table
and, for each claim of the GSPO paper, what this run measured and whether it holds here. It
reports what it measured: nothing is tuned to make a claim hold.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import finite  # noqa: E402  (needs REPO_ROOT on sys.path)

ARMS = {"gspo": ("example_gspo.yaml", []),
        "grpo": ("example_grpo.yaml", []),
        "grpo_replay": ("example_grpo.yaml", ["router_replay=true"])}
MODELS = {"dense": "builtin:tiny-arith", "moe": "builtin:tiny-moe"}
PANELS = [("reward/mean", "training reward"), ("val/accuracy", "validation accuracy"),
          ("actor/clipfrac", "clip fraction"), ("moe/expert_volatility", "expert volatility"),
          ("actor/grad_norm", "gradient norm"), ("rollout/logprob_gap", "trainer-rollout log-prob gap")]
# Smoke mode: random micro models (no warm start), one seed, one tiny step, the MoE model's three
# arms by default (each run pays the workers' start-up, ~20 s on an idle 2-core machine).
SMOKE_OVERRIDES = ["rollout_batch_size=4", "num_return_sequences_in_group=4", "eval_steps=2",
                   "actor_train.world_size=1", "actor_train.training_args.per_device_train_batch_size=4",
                   "actor_train.training_args.gradient_accumulation_steps=2",
                   "validation.data_args.max_samples=16"]


def arms_for(model: str) -> List[str]:
    return [arm for arm in ARMS if model == "moe" or arm != "grpo_replay"]


def run_one(model_path: str, arm: str, seed: int, max_steps: int, eval_steps: int, out: Path,
            extra: List[str]) -> List[Dict]:
    from roll_gspo.config import load_config

    from pipelines.rlvr_pipeline import run_rlvr

    config, arm_overrides = ARMS[arm]
    folder = out / "runs" / f"{Path(model_path).name}-{arm}-seed{seed}"
    overrides = [f"pretrain={model_path}", f"seed={seed}", f"max_steps={max_steps}", f"eval_steps={eval_steps}",
                 "save_steps=0", "save_total_limit=1", "track_with=none", f"output_dir={folder}",
                 f"exp_name={arm}-seed{seed}", *arm_overrides, *extra]
    cfg = load_config(config, overrides)
    run_rlvr(cfg)
    with open(folder / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def _mean(values: List[float]) -> float:
    values = finite(values)
    return sum(values) / len(values) if values else float("nan")


def _std(values: List[float]) -> float:
    values = finite(values)
    return statistics.stdev(values) if len(values) > 1 else 0.0


def val_key(record: Dict) -> Optional[str]:
    return "val/accuracy" if "val/accuracy" in record else next((k for k in record if k.startswith("val/acc")), None)


def run_summary(records: List[Dict]) -> Dict[str, float]:
    """One run's figures: first/last/mean validation accuracy, mean of each step metric, the
    largest gradient norm, and the worst drop of validation accuracy below its best so far."""
    steps = [r for r in records if "actor/clipfrac" in r]
    val = [(r["step"], r[val_key(r)]) for r in records if val_key(r)]
    out = {f"mean:{key}": _mean([r.get(key) for r in steps]) for key, _ in PANELS if key != "val/accuracy"}
    out["max:actor/grad_norm"] = max((r.get("actor/grad_norm", float("nan")) for r in steps), default=float("nan"))
    if val:
        val.sort()
        best, drawdown = -1.0, 0.0
        for _, acc in val:
            best = max(best, acc)
            drawdown = max(drawdown, best - acc)
        out.update({"val_first": val[0][1], "val_last": val[-1][1], "val_mean_after_0": _mean([a for s, a in val if s > 0]),
                    "val_drawdown": drawdown})
    last = steps[-len(steps) // 4 or -1:] if steps else []
    out["reward_last_quarter"] = _mean([r.get("reward/mean") for r in last])
    return out


def aggregate(runs: Dict[str, Dict[str, List[Dict]]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """model -> arm -> {figure: mean over seeds, figure+'_std': std over seeds, 'seeds': n}."""
    table: Dict[str, Dict[str, Dict[str, float]]] = {}
    for key, per_seed in runs.items():
        model, arm = key.split("/")
        summaries = [run_summary(records) for records in per_seed.values()]
        figures = {}
        for name in summaries[0]:
            values = [s.get(name, float("nan")) for s in summaries]
            figures[name], figures[name + "_std"] = _mean(values), _std(values)
        figures["seeds"] = len(summaries)
        table.setdefault(model, {})[arm] = figures
    return table


COLUMNS = [("val_first", "val acc step 0"), ("val_last", "val acc last"), ("val_mean_after_0", "val acc mean"),
           ("reward_last_quarter", "reward (last 1/4)"), ("mean:actor/clipfrac", "clip frac"),
           ("mean:moe/expert_volatility", "expert volatility"), ("mean:actor/grad_norm", "grad norm"),
           ("max:actor/grad_norm", "grad norm max"), ("val_drawdown", "val drawdown"),
           ("mean:rollout/logprob_gap", "logprob gap")]


def markdown_table(table) -> str:
    lines = ["| model | arm | seeds | " + " | ".join(label for _, label in COLUMNS) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"]
    for model, arms in table.items():
        for arm, f in arms.items():
            cells = []
            for key, _ in COLUMNS:
                value, std = f.get(key, float("nan")), f.get(key + "_std", 0.0)
                if not math.isfinite(value):
                    cells.append("n/a")
                elif key.endswith("logprob_gap"):
                    cells.append(f"{value:.1e}")
                else:
                    cells.append(f"{value:.4f}" + (f" ± {std:.4f}" if f["seeds"] > 1 else ""))
            lines.append(f"| {model} | {arm} | {f['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def claims(table) -> List[str]:
    """Each paper claim, what was measured, and a verdict at this scale."""
    out = []

    def get(model, arm, key):
        return table.get(model, {}).get(arm, {}).get(key, float("nan"))

    for model in table:
        g_clip, r_clip = get(model, "gspo", "mean:actor/clipfrac"), get(model, "grpo", "mean:actor/clipfrac")
        ratio = g_clip / r_clip if r_clip > 0 else float("inf")
        holds = g_clip > r_clip and ratio >= 10
        out.append(f"[{model}] GSPO clips far more tokens than GRPO (paper ~15% vs ~0.13%): GSPO {g_clip:.2%}, "
                   f"GRPO {r_clip:.2%} (x{ratio:.1f}) -> {'HOLDS' if holds else 'DOES NOT HOLD'} (criterion: >= 10x)")
        g_val, r_val = get(model, "gspo", "val_mean_after_0"), get(model, "grpo", "val_mean_after_0")
        noise = max(get(model, "gspo", "val_mean_after_0_std"), get(model, "grpo", "val_mean_after_0_std"))
        verdict = ("HOLDS" if g_val >= r_val else "WITHIN SEED NOISE" if r_val - g_val <= noise else "DOES NOT HOLD")
        out.append(f"[{model}] ... yet GSPO learns at least as fast (mean validation accuracy over the run): "
                   f"GSPO {g_val:.3f}, GRPO {r_val:.3f} (seed std up to {noise:.3f}) -> {verdict}")
    if "moe" in table:
        g_dd, r_dd = get("moe", "gspo", "val_drawdown"), get("moe", "grpo", "val_drawdown")
        g_gn, r_gn = get("moe", "gspo", "max:actor/grad_norm"), get("moe", "grpo", "max:actor/grad_norm")
        dd_noise = max(get("moe", "gspo", "val_drawdown_std"), get("moe", "grpo", "val_drawdown_std"))
        holds = r_dd > g_dd and r_gn > g_gn
        verdict = "DOES NOT HOLD" if not holds else "HOLDS" if r_dd - g_dd > dd_noise else "HOLDS, DRAWDOWN WITHIN SEED NOISE"
        out.append(f"[moe] GRPO without Routing Replay is less stable than GSPO: validation drawdown GRPO {r_dd:.3f} "
                   f"vs GSPO {g_dd:.3f} (seed std up to {dd_noise:.3f}), largest gradient norm GRPO {r_gn:.3f} vs "
                   f"GSPO {g_gn:.3f} -> {verdict} (criterion: both larger for GRPO)")
        rr_dd, rr_val = get("moe", "grpo_replay", "val_drawdown"), get("moe", "grpo_replay", "val_mean_after_0")
        rr_noise = max(get("moe", "grpo_replay", "val_drawdown_std"), get("moe", "grpo", "val_drawdown_std"))
        verdict = ("DOES NOT HOLD" if rr_dd - r_dd > rr_noise else "HOLDS" if r_dd - rr_dd > rr_noise
                   else "NO DIFFERENCE BEYOND SEED NOISE")
        out.append(f"[moe] Routing Replay steadies GRPO: drawdown with replay {rr_dd:.3f} vs without {r_dd:.3f} "
                   f"(seed std up to {rr_noise:.3f}), mean validation accuracy {rr_val:.3f} vs "
                   f"{get('moe', 'grpo', 'val_mean_after_0'):.3f} -> {verdict} (criterion: drawdown smaller by "
                   f"more than the seed std)")
        vol = {arm: get("moe", arm, "mean:moe/expert_volatility") for arm in arms_for("moe")}
        out.append("[moe] expert activation volatility after one step (paper: ~10% in a 48-layer MoE): "
                   + ", ".join(f"{arm} {v:.2%}" for arm, v in vol.items())
                   + " (measured, 4 layers here; no verdict: depth and scale differ)")
    return out


def plot(runs: Dict[str, Dict[str, List[Dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    # One colour per model/arm in every panel (a panel without the dense runs must not shift them).
    colours = {run_key: f"C{i}" for i, run_key in enumerate(runs)}
    for ax, (key, title) in zip(axes.flat, PANELS):
        for run_key, per_seed in runs.items():
            series: Dict[int, List[float]] = {}
            for records in per_seed.values():
                for r in records:
                    k = val_key(r) if key == "val/accuracy" else key
                    if k and r.get(k) is not None:
                        series.setdefault(r["step"], []).append(r[k])
            if series:
                steps = sorted(series)
                ax.plot(steps, [_mean(series[s]) for s in steps], marker="." if key == "val/accuracy" else None,
                        label=run_key, color=colours[run_key])
        ax.set_title(title)
        ax.set_xlabel("step")
        if key in ("rollout/logprob_gap",):
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("GSPO vs GRPO vs GRPO + Routing Replay (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def smoke_models(cache: str) -> Dict[str, str]:
    from roll_gspo.builtin.models import build_base_model, build_base_moe_model

    return {"dense": build_base_model(os.path.join(cache, "study-smoke-dense"), size="micro"),
            "moe": build_base_moe_model(os.path.join(cache, "study-smoke-moe"), size="micro")}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="./output/study_gspo_vs_grpo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        help="default: dense and moe (--smoke: moe)")
    parser.add_argument("--smoke", action="store_true", help="micro random models, one seed, 1 tiny step")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild the table, claims and plot from <out>/runs.jsonl")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (a.b=value)")
    args = parser.parse_args(argv)
    if args.report_only:
        return report_from_log(Path(args.out).resolve())

    import ray

    from roll_gspo.builtin.cache import cache_root
    from roll_gspo.builtin.models import resolve_model

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    extra = list(args.overrides)
    if args.smoke:
        models = {k: v for k, v in smoke_models(cache_root()).items() if k in (args.models or ["moe"])}
        seeds, max_steps, eval_steps = args.seeds[:1], 1, 1
        extra = SMOKE_OVERRIDES + extra
    else:
        models = {k: resolve_model(MODELS[k]) for k in (args.models or list(MODELS))}  # warm starts, once, before the clock matters
        seeds, max_steps, eval_steps = args.seeds, args.max_steps, args.eval_steps
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    runs: Dict[str, Dict[str, List[Dict]]] = {}
    start = time.perf_counter()
    try:
        with open(out / "runs.jsonl", "w") as log:
            for model, path in models.items():
                for arm in arms_for(model):
                    for seed in seeds:
                        began = time.perf_counter()
                        records = run_one(path, arm, seed, max_steps, eval_steps, out, extra)
                        runs.setdefault(f"{model}/{arm}", {})[seed] = records
                        for r in records:
                            log.write(json.dumps({"model": model, "arm": arm, "seed": seed, **r}) + "\n")
                        log.flush()
                        print(f"[study] {model} {arm} seed {seed}: {len(records)} records, "
                              f"{time.perf_counter() - began:.0f} s", flush=True)
    finally:
        if started_ray:
            ray.shutdown()
    summary = {"wall_seconds": time.perf_counter() - start, "seeds": seeds, "max_steps": max_steps,
               "smoke": args.smoke}
    report(runs, out, summary)
    return 0


def report_from_log(out: Path) -> int:
    """The report of an earlier study, from its runs.jsonl (and the run facts of its summary.json)."""
    runs: Dict[str, Dict[str, List[Dict]]] = {}
    with open(out / "runs.jsonl") as log:
        for line in log:
            row = json.loads(line)
            model, arm, seed = row.pop("model"), row.pop("arm"), row.pop("seed")
            runs.setdefault(f"{model}/{arm}", {}).setdefault(seed, []).append(row)
    old = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    seeds = sorted({seed for per_seed in runs.values() for seed in per_seed})
    steps = max((r["step"] for per_seed in runs.values() for rows in per_seed.values() for r in rows), default=0)
    report(runs, out, {"wall_seconds": old.get("wall_seconds", float("nan")), "seeds": seeds, "max_steps": steps,
                       "smoke": old.get("smoke", False)})
    return 0


def report(runs: Dict[str, Dict[str, List[Dict]]], out: Path, summary: Dict) -> None:
    """Write table.md, summary.json and study.png into `out` and print the table and the claims."""
    table = aggregate(runs)
    verdicts = claims(table)
    text = markdown_table(table)
    (out / "table.md").write_text(text + "\n\n" + "\n".join(f"- {line}" for line in verdicts) + "\n")
    (out / "summary.json").write_text(json.dumps({"table": table, "claims": verdicts, **summary}, indent=1))
    plot(runs, out / "study.png")
    seeds, max_steps, wall = summary["seeds"], summary["max_steps"], summary["wall_seconds"]
    print("\n== GSPO vs GRPO study ==")
    print(f"{len(seeds)} seed(s) x {max_steps} steps, runs took {wall:.0f} s; files in {out}")
    print(text)
    print("\nThe paper's claims at this scale:")
    for line in verdicts:
        print(" -", line)


if __name__ == "__main__":
    sys.exit(main())
