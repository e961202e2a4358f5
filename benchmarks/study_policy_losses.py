"""The GSPO family side by side at equal steps: GSPO, GSPO-token, GRPO, CISPO, SAPO, GMPO, LUSPO,
VESPO and on-policy distillation (OPD), N seeds, on the built-in model or SmolLM2.

    .venv/bin/python benchmarks/study_policy_losses.py --model builtin --markdown table.md
    .venv/bin/python benchmarks/study_policy_losses.py --model smollm2 --seeds 0 1 --max-steps 20
    .venv/bin/python benchmarks/study_policy_losses.py --arms gspo grpo --seeds 3 --max-steps 10
    .venv/bin/python benchmarks/study_policy_losses.py --report-only --out DIR --markdown table.md

Each arm is the model's GSPO example (`--model builtin`: examples/example_gspo.yaml, the tiny
arithmetic model; `smollm2`: examples/example_gspo_smollm2.yaml and its task mix) with the keys that
make it that loss and nothing else (`ARMS`): each loss keeps its documented defaults (its own keys
unwritten; docs/algorithm.md "Policy losses"), token-level losses take GRPO's token-mean
aggregation, and no arm is tuned. The OPD arm is GSPO-token plus `use_opd` (examples/example_opd.yaml)
with a teacher sharing the student's tokenizer: `--teacher`, else this study's GSPO run of the same
seed (its final_model/, trained the same number of steps), so OPD runs after GSPO; without either
the arm is skipped and the table says so. No stronger built-in model exists to teach either model.

Per arm, mean and seed spread of: held-out greedy accuracy per task at step 0 and at the last step
(and their task mean and change; "acc over run": the task mean of every validation after step 0,
which tells a faster learner from one that only ends as high; "val drawdown": the largest fall of
that mean below its best so far), the clip fraction (`actor/clipfrac`) and the loss's own gauge
(CISPO's clipped weights, SAPO's gate below 0.5, GMPO's log clip, VESPO's mean weight phi, OPD's
reverse KL to the teacher), entropy
and response length over the last quarter of steps, the trainer-vs-rollout log-prob gap, the median
step and the run's wall time. Writes <out>/runs.jsonl (every step of every run), <out>/summary.json
(or --json) and, with --markdown, the table. Exit 1 if a run failed (the table marks it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import (mean_finite, median, run_rlvr_in_process, stdev_finite,  # noqa: E402
                                validation_tasks)

MODELS = {"builtin": "examples/example_gspo.yaml", "smollm2": "examples/example_gspo_smollm2.yaml"}
# GMPO's log-space clip when a YAML writes none (roll_gspo/config/checks/policy_loss.py: the GMPO
# paper's e^-0.4 .. e^0.4). The GSPO examples write GSPO's 3e-3 / 4e-3, so the arm writes GMPO's own.
GMPO_LOG_CLIP = 0.4
# example_grpo.yaml (and example_grpo_smollm2.yaml) against their GSPO examples.
GRPO_KEYS = ["importance_sampling=token", "loss_agg_mode=token-mean", "pg_clip_low=0.2", "pg_clip_high=0.28"]
TOKEN_LEVEL = ["importance_sampling=token", "loss_agg_mode=token-mean"]  # CISPO and SAPO are token-level losses
ARMS: Dict[str, Dict[str, Any]] = {
    "gspo": {"title": "GSPO (clip, seq)", "overrides": []},
    "gspo_token": {"title": "GSPO-token", "overrides": ["importance_sampling=gspo-token"]},
    "grpo": {"title": "GRPO (clip, token, 0.2/0.28)", "overrides": GRPO_KEYS},
    "cispo": {"title": "CISPO", "overrides": ["policy_loss=cispo", *TOKEN_LEVEL]},
    "sapo": {"title": "SAPO", "overrides": ["policy_loss=sapo", *TOKEN_LEVEL]},
    "gmpo": {"title": "GMPO", "overrides": ["policy_loss=gmpo", f"pg_clip_low={GMPO_LOG_CLIP}",
                                            f"pg_clip_high={GMPO_LOG_CLIP}"]},
    "luspo": {"title": "LUSPO", "overrides": ["policy_loss=luspo", "loss_agg_mode=seq-mean-token-sum"]},
    "vespo": {"title": "VESPO", "overrides": ["policy_loss=vespo"]},
    "opd": {"title": "OPD + task reward (GSPO-token)",
            "overrides": ["use_opd=true", "importance_sampling=gspo-token", "opd_kl_coef=1.0",
                          "teacher.strategy_args.strategy_name=hf_infer", "teacher.num_cpus_per_worker=0.25"]},
}
# The loss's own activity, summed per step (default: actor/clipfrac); label for the table.
GAUGES: Dict[str, Any] = {
    "cispo": ("IS weight clipped", ["actor/cispo_clipfrac_low", "actor/cispo_clipfrac_high"]),
    "sapo": ("gate < 0.5", ["actor/sapo_gate_off_frac"]),
    "gmpo": ("log-clipped", ["actor/gmpo_clipfrac_low", "actor/gmpo_clipfrac_high"]),
    "vespo": ("mean phi(w)", ["actor/vespo_phi_mean"]),
    "opd": ("reverse KL", ["opd/reverse_kl"]),
}
DEFAULT_GAUGE = ("clip frac", ["actor/clipfrac"])


def arm_overrides(arm: str, teacher: Optional[str] = None) -> List[str]:
    """The overrides that turn the model's GSPO example into `arm`; the OPD arm needs its teacher."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")
    overrides = list(ARMS[arm]["overrides"])
    if arm == "opd":
        if not teacher:
            raise ValueError("arm opd needs a teacher model (--teacher, or the study's gspo arm run first)")
        overrides.append(f"teacher.model_args.model_name_or_path={teacher}")
    return overrides


def run_overrides(arm: str, seed: int, max_steps: int, eval_steps: int, teacher: Optional[str] = None,
                  extra: Sequence[str] = ()) -> List[str]:
    """Every override of one run: the arm's, the seed, equal steps, no checkpoints, then `extra`."""
    return [f"seed={seed}", f"max_steps={max_steps}", f"eval_steps={eval_steps}", "save_steps=0",
            "track_with=none", f"exp_name={arm}-seed{seed}", *arm_overrides(arm, teacher), *extra]


def _quarter(steps: List[Dict], key: str) -> float:
    """Mean of `key` over the last quarter of the steps (at least one)."""
    return mean_finite(r.get(key) for r in steps[-max(1, len(steps) // 4):])


def run_summary(arm: str, records: List[Dict], wall_s: float = float("nan")) -> Dict[str, Any]:
    """One run's figures (see the module docstring); `acc_first` / `acc_last` per task."""
    steps = [r for r in records if "actor/pg_loss" in r]
    tasks = validation_tasks(records)
    val = sorted((r for r in records if tasks and f"val/{tasks[0]}/accuracy" in r), key=lambda r: r["step"])
    first, last = (val[0], val[-1]) if val else ({}, {})
    _, gauge_keys = GAUGES.get(arm, DEFAULT_GAUGE)
    gauge = [sum(r[k] for k in gauge_keys) if all(k in r for k in gauge_keys) else None for r in steps]
    out: Dict[str, Any] = {
        "acc_first": {t: first.get(f"val/{t}/accuracy", float("nan")) for t in tasks},
        "acc_last": {t: last.get(f"val/{t}/accuracy", float("nan")) for t in tasks},
        "first_step": first.get("step"), "last_step": last.get("step"), "steps": len(steps),
        "clipfrac": mean_finite(r.get("actor/clipfrac") for r in steps),
        "gauge": mean_finite(gauge),
        "entropy": _quarter(steps, "actor/entropy"),
        "length": _quarter(steps, "response/length_mean"),
        "reward": _quarter(steps, "reward/mean"),
        "logprob_gap": mean_finite(r.get("rollout/logprob_gap") for r in steps),
        "opd_reverse_kl": mean_finite(r.get("opd/reverse_kl") for r in steps),
        "step_s": median(r.get("time/step_s") for r in steps) or float("nan"),
        "wall_s": wall_s,
    }
    # the task-mean accuracy of every validation after step 0: how fast, not only how far
    out["mean_run"] = mean_finite(mean_finite(r.get(f"val/{t}/accuracy") for t in tasks) for r in val
                                  if r["step"] > 0)
    # the largest fall of the task-mean validation accuracy below its best so far (0: never fell)
    best, out["drawdown"] = -1.0, 0.0
    for r in val:
        acc = mean_finite(r.get(f"val/{t}/accuracy") for t in tasks)
        best, out["drawdown"] = max(best, acc), max(out["drawdown"], best - acc)
    out["mean_first"] = mean_finite(out["acc_first"].values())
    out["mean_last"] = mean_finite(out["acc_last"].values())
    out["delta"] = out["mean_last"] - out["mean_first"]
    return out


SCALARS = ["mean_first", "mean_last", "delta", "mean_run", "drawdown", "clipfrac", "gauge", "entropy", "length", "reward", "logprob_gap",
           "opd_reverse_kl", "step_s", "wall_s"]


def aggregate(per_seed: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """One arm over seeds: each figure's mean and `<figure>_std`; per-task accuracies likewise."""
    runs = list(per_seed.values())
    out: Dict[str, Any] = {"seeds": len(runs)}
    for key in SCALARS:
        values = [r.get(key) for r in runs]
        out[key], out[key + "_std"] = mean_finite(values), stdev_finite(values)
    for which in ("acc_first", "acc_last"):
        tasks = sorted({t for r in runs for t in r.get(which, {})})
        out[which] = {t: mean_finite(r[which].get(t) for r in runs) for t in tasks}
        out[which + "_std"] = {t: stdev_finite(r[which].get(t) for r in runs) for t in tasks}
    return out


def separation(table: Dict[str, Dict[str, Any]], baseline: str = "gspo") -> List[str]:
    """Each arm's final task-mean accuracy against the baseline's: apart only when the gap exceeds
    the two seed spreads added (with 1 seed nothing can be told apart)."""
    base = table.get(baseline)
    if not base or not math.isfinite(base.get("mean_last", float("nan"))):
        return [f"no {baseline} arm: nothing to compare against"]
    lines = []
    for arm, f in table.items():
        if arm == baseline or not math.isfinite(f.get("mean_last", float("nan"))):
            continue
        gap = f["mean_last"] - base["mean_last"]
        noise = f.get("mean_last_std", 0.0) + base.get("mean_last_std", 0.0)
        if min(f["seeds"], base["seeds"]) < 2:
            verdict = "one seed: no spread to judge by"
        elif abs(gap) > noise:
            verdict = "ABOVE" if gap > 0 else "BELOW"
        else:
            verdict = "within seed noise"
        lines.append(f"{arm}: {f['mean_last']:.3f} vs {baseline} {base['mean_last']:.3f} ({gap:+.3f}; spreads "
                     f"added {noise:.3f}) -> {verdict}")
    return lines


def _cell(value: Optional[float], std: Optional[float], seeds: int, spec: str = ".3f") -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return format(value, spec) + (f" ± {format(std or 0.0, spec.lstrip('+'))}" if seeds > 1 else "")


def markdown_table(table: Dict[str, Dict[str, Any]], skipped: Optional[Dict[str, str]] = None) -> str:
    """One row per arm (mean ± seed std); per-task columns are the last validation's accuracy."""
    tasks = sorted({t for f in table.values() for t in f.get("acc_last", {})})
    heads = (["arm", "loss", "seeds", "acc step 0"] + [f"acc {t}" for t in tasks]
             + ["acc mean", "Δ acc", "acc over run", "val drawdown", "clip frac", "loss gauge", "entropy", "length", "logprob gap", "step s", "wall s"])
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    for arm, f in table.items():
        n = f["seeds"]
        label, _ = GAUGES.get(arm, DEFAULT_GAUGE)
        if "failed" in f:
            lines.append(f"| {arm} | {ARMS.get(arm, {}).get('title', arm)} | failed: {f['failed'].replace('|', '/')} |"
                         + " |" * (len(heads) - 3))
            continue
        cells = [arm, ARMS.get(arm, {}).get("title", arm), str(n), _cell(f["mean_first"], f["mean_first_std"], n)]
        cells += [_cell(f["acc_last"].get(t), f["acc_last_std"].get(t), n) for t in tasks]
        cells += [_cell(f["mean_last"], f["mean_last_std"], n), _cell(f["delta"], f["delta_std"], n, "+.3f"),
                  _cell(f["mean_run"], f["mean_run_std"], n), _cell(f["drawdown"], f["drawdown_std"], n),
                  _cell(f["clipfrac"], f["clipfrac_std"], n),
                  ("" if label == DEFAULT_GAUGE[0] else f"{label}: ") + _cell(f["gauge"], f["gauge_std"], n),
                  _cell(f["entropy"], f["entropy_std"], n), _cell(f["length"], f["length_std"], n, ".2f"),
                  _cell(f["logprob_gap"], None, 1, ".1e"), _cell(f["step_s"], None, 1, ".2f"),
                  _cell(f["wall_s"], None, 1, ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    for arm, why in (skipped or {}).items():
        lines.append(f"| {arm} | {ARMS.get(arm, {}).get('title', arm)} | not run: {why} |" + " |" * (len(heads) - 3))
    return "\n".join(lines)


def build_table(runs: Dict[str, Dict[int, Dict[str, Any]]], failures: Dict[str, str]) -> Dict[str, Dict[str, Any]]:
    """arm -> its aggregate over the seeds that finished; an arm with no finished run: {"failed": why}."""
    table: Dict[str, Dict[str, Any]] = {}
    for arm in ARMS:
        if runs.get(arm):
            table[arm] = aggregate(runs[arm])
            if arm in failures:
                table[arm]["partial_failure"] = failures[arm]
        elif arm in failures:
            table[arm] = {"seeds": 0, "failed": failures[arm]}
    return table


def report(runs: Dict[str, Dict[int, Dict[str, Any]]], failures: Dict[str, str], skipped: Dict[str, str],
           facts: Dict[str, Any], json_path: Path, markdown_path: Optional[str]) -> str:
    table = build_table(runs, failures)
    text = markdown_table(table, skipped)
    verdicts = separation(table)
    json_path.write_text(json.dumps({**facts, "table": table, "runs": {a: {str(s): r for s, r in per.items()}
                                                                       for a, per in runs.items()},
                                     "failures": failures, "skipped": skipped, "separation": verdicts}, indent=1))
    body = text + "\n\nFinal task-mean accuracy against GSPO:\n" + "\n".join(f"- {v}" for v in verdicts) + "\n"
    if markdown_path:
        Path(markdown_path).write_text(body)
    print(f"\n== policy-loss study: {facts['model']}, {len(facts['seeds'])} seed(s) x {facts['max_steps']} steps, "
          f"{facts['wall_seconds']:.0f} s; {json_path} ==")
    print(body)
    return body


def report_from_log(out: Path, json_path: Path, markdown_path: Optional[str]) -> int:
    """Rebuild summary and table from an earlier study's runs.jsonl (and its summary's run facts)."""
    old = json.loads(json_path.read_text()) if json_path.exists() else {}
    records: Dict[str, Dict[int, List[Dict]]] = {}
    with open(out / "runs.jsonl") as log:
        for line in log:
            row = json.loads(line)
            arm, seed = row.pop("arm"), row.pop("seed")
            records.setdefault(arm, {}).setdefault(seed, []).append(row)
    wall = {arm: {int(s): r.get("wall_s", float("nan")) for s, r in per.items()}
            for arm, per in old.get("runs", {}).items()}
    runs = {arm: {seed: run_summary(arm, rows, wall.get(arm, {}).get(seed, float("nan")))
                  for seed, rows in per.items()} for arm, per in records.items()}
    facts = {k: old.get(k) for k in ("model", "config", "seeds", "max_steps", "eval_steps", "teacher")}
    # a study still running (or its summary lost): what the log itself says
    facts["seeds"] = facts["seeds"] or sorted({seed for per in records.values() for seed in per})
    facts["max_steps"] = facts["max_steps"] or max((r["step"] for per in records.values() for rows in per.values()
                                                   for r in rows), default=0)
    facts["wall_seconds"] = old.get("wall_seconds", float("nan"))
    report(runs, old.get("failures", {}), old.get("skipped", {}), facts, json_path, markdown_path)
    return 0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="builtin")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-steps", type=int, default=20, help="steps of every run (equal for all arms)")
    parser.add_argument("--eval-steps", type=int, default=10, help="validation every this many steps (and at 0)")
    parser.add_argument("--teacher", help="OPD's teacher model (a folder or builtin: name sharing the tokenizer); "
                                          "default: this study's gspo run of the same seed")
    parser.add_argument("--out", help="default: ./output/study_policy_losses_<model>")
    parser.add_argument("--json", help="the summary JSON (default: <out>/summary.json)")
    parser.add_argument("--markdown", help="write the markdown table (and the comparison with GSPO) here")
    parser.add_argument("--report-only", action="store_true", help="run nothing: rebuild from <out>/runs.jsonl")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (a.b=value)")
    args = parser.parse_args(argv)
    if args.max_steps < 1 or args.eval_steps < 1:
        parser.error("--max-steps and --eval-steps must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or f"./output/study_policy_losses_{args.model}").resolve()
    json_path = Path(args.json).resolve() if args.json else out / "summary.json"
    if args.report_only:
        return report_from_log(out, json_path, args.markdown)
    import ray

    from benchmarks.harness import init_local_ray
    from roll_gspo.builtin.models import resolve_model
    from roll_gspo.config import load_config

    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    config = str(REPO_ROOT / MODELS[args.model])
    resolve_model(load_config(config).pretrain)  # the warm start, once, before any clock
    arms = [a for a in ARMS if a in args.arms]  # ARMS order: opd after gspo
    runs: Dict[str, Dict[int, Dict[str, Any]]] = {}
    failures: Dict[str, str] = {}
    skipped: Dict[str, str] = {}
    started_ray = not ray.is_initialized()
    if started_ray:
        init_local_ray(4)
    start = time.perf_counter()
    try:
        with open(out / "runs.jsonl", "w") as log:
            for seed in args.seeds:
                for arm in arms:
                    teacher = args.teacher
                    if arm == "opd" and not teacher:
                        final = out / "runs" / f"gspo-seed{seed}" / "final_model"
                        if not (final / "config.json").is_file():
                            skipped[arm] = ("no teacher: give --teacher or run the gspo arm too (its final "
                                            "model of the same seed teaches)")
                            continue
                        teacher = str(final)
                    folder = out / "runs" / f"{arm}-seed{seed}"
                    began = time.perf_counter()
                    try:
                        records = run_rlvr_in_process(config, run_overrides(arm, seed, args.max_steps,
                                                                            args.eval_steps, teacher, args.overrides),
                                                      str(folder))
                    except Exception as exc:  # noqa: BLE001  (a failed arm is reported, the others still run)
                        traceback.print_exc()
                        failures[arm] = f"seed {seed}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                        continue
                    wall = time.perf_counter() - began
                    runs.setdefault(arm, {})[seed] = run_summary(arm, records, wall)
                    for r in records:
                        log.write(json.dumps({"arm": arm, "seed": seed, **r}) + "\n")
                    log.flush()
                    s = runs[arm][seed]
                    print(f"[study] {arm} seed {seed}: accuracy {s['mean_first']:.3f} -> {s['mean_last']:.3f} "
                          f"in {s['steps']} steps, {wall:.0f} s", flush=True)
    finally:
        if started_ray:
            ray.shutdown()
    facts = {"model": args.model, "config": MODELS[args.model], "seeds": args.seeds, "max_steps": args.max_steps,
             "eval_steps": args.eval_steps, "teacher": args.teacher or "the gspo run of the same seed",
             "overrides": args.overrides, "wall_seconds": time.perf_counter() - start}
    report(runs, failures, skipped, facts, json_path, args.markdown)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
