"""What does asynchronous rollout buy with heavy-tailed response lengths, rollout and training on
their own CPUs? (issue 37 item 6)

    .venv/bin/python benchmarks/bench_async.py                 # 2 warm-up + 10 measured steps per mode
    .venv/bin/python benchmarks/bench_async.py --steps 20 --json async.json
    .venv/bin/python benchmarks/bench_async.py --seeds 42 43 44 --modes sync k2 k2_decoupled   # seed noise
    .venv/bin/python benchmarks/bench_async.py --quick --model /path/to/micro_model   # the test's run

One private Ray; the same RLVR run (`examples/example_gspo.yaml` on `builtin:tiny-arith`, GSPO, old
log-probs from the rollout engine in every mode so the trainer does the same work) four times:
`async_generation_ratio` 0 (synchronous), 1 (one step ahead), 2 and 4 (request pools: partial
rollouts, streaming of complete groups); on request `k2_decoupled` / `k4_decoupled`, the same pools
with decoupled PPO (the trainer's recompute as the proximal policy, a per-token weight for the
staleness). Once per `--seeds` value. Each mode trains the same number of steps, so the same
number of samples, then validates (greedy, `builtin:arith_easy/val`).

**The workload.** The built-in arithmetic model answers its own prompts in 3 tokens (2 characters
+ <eos>) whatever the temperature. Its training data here is one part in four (`--long-share`) the built-in
code task's prompts (`builtin:mixed`, code_sandbox rows; routed to the math rule, which scores them 0):
prompts it never saw, which it answers at length, many to the cap (`response_length: 32`). The
lengths are what the model samples, nothing imposed; the table prints their median, p90, p99 and
the share at >= 8x the median.

**Own CPUs.** actor_train one rank with 1 CPU reserved and OMP_NUM_THREADS=1, actor_infer 1 CPU and
OMP_NUM_THREADS=1 (the YAML's reservations; no core pinning: the OS schedules the threads).

**Figures** (over the measured steps; the window runs from the first measured step's start to the
last one's end):

* trained tokens / s: the response tokens of the trained batches / window seconds;
* rollout-engine idle: 1 - (seconds some generation call ran on the rollout rank within the window)
  / window. A call's time runs from its dispatch to its result being ready (a driver thread waits on
  the Ray references: the engine's own work plus the transfer); synchronous calls are the step's
  `time/generate_s`;
* trainer idle: 1 - (time/old_log_probs_s + time/reference_s + time/train_s + time/sync_s) / step
  wall, summed over the steps (the phases in which the trainer ranks compute or send weights).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import build_overrides, fmt, init_local_ray, print_report, required_cpus  # noqa: E402

MODES: Tuple[Tuple[str, int], ...] = (("sync", 0), ("one_ahead", 1), ("k2", 2), ("k4", 4),
                                      ("k2_decoupled", 2), ("k4_decoupled", 4))
DEFAULT_MODES = ("sync", "one_ahead", "k2", "k4")
# Decoupled PPO (AReaL): the trainer's recompute under the weights of step - 1 is the proximal policy the
# ratio is clipped against; the per-token weight exp(proximal - behaviour) carries the staleness.
DECOUPLED = ["old_logprob_source=trainer", "train_infer_correction.is_weight.enabled=true",
             "train_infer_correction.is_weight.weight_type=token"]
LONG_SHARE = 0.25  # one training prompt in four is a code prompt (--long-share)


def mixed_train_file(folder: str, n: int, seed: int = 0, long_share: float = LONG_SHARE) -> str:
    """`n` rows: arith_easy train prompts and, one in 1 / long_share, a code-task prompt (domain
    code_sandbox, routed to the math rule)."""
    from roll_gspo.builtin.tasks import resolve_data_file

    def rows(name: str, domain: Optional[str] = None) -> List[dict]:
        with open(resolve_data_file(name)) as handle:
            loaded = [json.loads(line) for line in handle]
        return [r for r in loaded if domain is None or r["domain"] == domain]

    arith, code = rows("builtin:arith_easy/train"), rows("builtin:mixed/train", "code_sandbox")
    rng = random.Random(seed)
    out = [rng.choice(code) if rng.random() < long_share else rng.choice(arith) for _ in range(n)]
    path = os.path.join(folder, "train_heavy_tail.jsonl")
    with open(path, "w") as handle:
        for row in out:
            handle.write(json.dumps({k: row[k] for k in ("prompt", "ground_truth", "domain")}) + "\n")
    return path


def mode_overrides(ratio: int, train_file: str, quick: bool, name: str = "") -> List[str]:
    """The YAML keys every mode shares (own CPUs, the workload) and the mode's own. Old log-probs come
    from the rollout engine (the trainer does the same work in every mode) except in the decoupled
    modes."""
    keys = [f"async_generation_ratio={ratio}", "old_logprob_source=rollout",
            f"actor_train.data_args.file_name=[{train_file}]", "prompt_length=32", "rewards.math_rule.tag_included=[code_sandbox]",
            "actor_train.world_size=1", "actor_train.num_cpus_per_worker=1",
            "actor_train.system_envs.OMP_NUM_THREADS='1'",
            "actor_infer.num_cpus_per_worker=1", "actor_infer.system_envs.OMP_NUM_THREADS='1'"]
    if quick:  # structure only: micro shapes, the HF rollout engine (no vLLM start per mode)
        keys += ["rollout_batch_size=2", "num_return_sequences_in_group=4", "response_length=8",
                 "actor_train.training_args.per_device_train_batch_size=4", "actor_train.infer_batch_size=8",
                 "actor_infer.strategy_args.strategy_name=hf_infer",
                 "validation.data_args.file_name=[" + train_file + "]"]
    else:
        keys += ["rollout_batch_size=32", "num_return_sequences_in_group=8", "response_length=32",
                 "actor_train.training_args.per_device_train_batch_size=64",
                 "actor_infer.strategy_args.strategy_config.max_model_len=64"]
    if name.endswith("_decoupled"):
        keys = [k for k in keys if not k.startswith("old_logprob_source=")] + DECOUPLED
    return keys


class Intervals:
    """Seconds generation calls ran: (start, end) per call, from perf_counter."""

    def __init__(self):
        self.spans: List[Tuple[float, float]] = []
        self.lock = threading.Lock()
        self.threads: List[threading.Thread] = []

    def add(self, start: float, end: float) -> None:
        with self.lock:
            self.spans.append((start, end))

    def watch(self, refs: list, start: float) -> None:
        """A thread that records when every reference is ready."""
        import ray

        def wait() -> None:
            ray.wait(list(refs), num_returns=len(refs))
            self.add(start, time.perf_counter())

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        self.threads.append(thread)

    def within(self, start: float, end: float) -> float:
        for thread in self.threads:
            thread.join()
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.spans)


def timed_source(intervals: Intervals, lengths: List[int]):
    """The RLVR source the run plan picks, its generation calls timed into `intervals` and every
    trained response's length appended to `lengths` (a `make_source` for the trainer loop)."""
    from pipelines.rlvr_pipeline import PooledPromptGroupSource, PromptGroupSource

    def timed(base):
        class TimedSource(base):
            def start_ahead(self, step):
                start = time.perf_counter()
                calls = super().start_ahead(step)
                intervals.watch(calls, start)
                return calls

            def step_metrics(self, rollout, step_seconds):
                lengths.extend(int(n) for n in rollout.batch["response_mask"].sum(-1).tolist())
                return super().step_metrics(rollout, step_seconds)

        return TimedSource

    class TimedPlainSource(timed(PromptGroupSource)):
        def produce(self, step, timings):  # the pooled source's goes through start_ahead, whose watcher times it
            start = time.perf_counter()
            rollout = super().produce(step, timings)
            intervals.add(start, time.perf_counter())
            return rollout

    def make(cfg, tokenizer, plan):
        if plan.staleness_bound is not None:
            return timed(PooledPromptGroupSource)(cfg, tokenizer, plan.staleness_bound)
        return TimedPlainSource(cfg, tokenizer)

    return make


def length_stats(lengths: Sequence[float]) -> Dict[str, float]:
    ordered = sorted(lengths)
    med = statistics.median(ordered)

    def quantile(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"median": float(med), "p90": quantile(0.9), "p99": quantile(0.99), "max": float(ordered[-1]),
            "share_ge_8x_median": sum(length >= 8 * med for length in ordered) / len(ordered)}


def run_mode(name: str, ratio: int, args, base: List[str], train_file: str, seed: int) -> Dict[str, Any]:
    """One mode: start the pipeline, warm-up + measured steps, validation, shut down."""
    from roll_gspo.config import load_config

    from pipelines.trainer_loop import TrainerLoop

    cfg = load_config(args.config, [*base, *mode_overrides(ratio, train_file, args.quick, name), f"seed={seed}",
                                    *args.override])
    intervals, lengths = Intervals(), []
    start = time.perf_counter()
    loop = TrainerLoop(cfg, timed_source(intervals, lengths))
    startup = time.perf_counter() - start
    metrics, walls = [], []
    try:
        total = args.warmup + args.steps
        window_start = None
        for step in range(1, total + 1):
            if step == args.warmup + 1:
                window_start = time.perf_counter()
            begin = time.perf_counter()
            result = loop.step(step)
            walls.append(time.perf_counter() - begin)
            metrics.append(result)
            print(f"  [{name}] step {step}/{total}: {walls[-1]:.2f} s", flush=True)
        window_end = time.perf_counter()
        val = loop.source.validate(total)
        per_step_tokens = [m["response/length_mean"] * cfg.rollout_batch_size * cfg.num_return_sequences_in_group
                           for m in metrics[args.warmup:]]
        window = window_end - window_start
        measured, measured_walls = metrics[args.warmup:], walls[args.warmup:]
        trainer_busy = sum(sum(m.get(f"time/{p}_s", 0.0) for p in ("old_log_probs", "reference", "train", "sync"))
                           for m in measured)
        rollout_busy = intervals.within(window_start, window_end)
        return {"mode": name, "async_generation_ratio": ratio, "seed": seed, "startup_s": startup, "window_s": window,
                "steps": args.steps, "samples": args.steps * cfg.rollout_batch_size * cfg.num_return_sequences_in_group,
                "trained_tokens": sum(per_step_tokens), "tokens_per_s": sum(per_step_tokens) / window,
                "rollout_idle_frac": max(0.0, 1.0 - rollout_busy / window),
                "trainer_idle_frac": max(0.0, 1.0 - trainer_busy / sum(measured_walls)),
                "step_s_median": statistics.median(measured_walls),
                "generate_wait_s_median": statistics.median(m.get("time/generate_s", 0.0) for m in measured),
                "staleness_max": max(m.get("rollout/staleness_max", m.get("rollout/staleness", 0.0)) for m in measured),
                "dropped_past_bound": sum(m.get("rollout/dropped_past_bound", 0.0) for m in measured),
                # the share of tokens whose clipped branch is taken: a stale denominator far outside GSPO's
                # narrow clip range gives no gradient, whatever the samples say
                "clipfrac_mean": statistics.mean(m.get("actor/clipfrac", 0.0) for m in measured),
                "lengths": length_stats(lengths), "val_accuracy": val.get("val/accuracy"), "step_walls": walls}
    finally:
        loop.shutdown()


def format_table(report: Dict[str, Any]) -> str:
    rows = report["modes"]
    lines = [f"{'mode':<12} {'k':>2} {'seed':>4} {'tokens/s':>9} {'rollout idle':>12} {'trainer idle':>12} "
             f"{'step s':>7} {'gen wait s':>10} {'stale max':>9} {'dropped':>7} {'clipfrac':>8} {'val acc':>7} "
             f"{'samples':>7}"]
    for r in rows:
        lines.append(f"{r['mode']:<12} {r['async_generation_ratio']:>2} {r.get('seed', ''):>4} "
                     f"{fmt(r['tokens_per_s'], '.1f'):>9} "
                     f"{fmt(r['rollout_idle_frac'], '.2f'):>12} {fmt(r['trainer_idle_frac'], '.2f'):>12} "
                     f"{fmt(r['step_s_median'], '.2f'):>7} {fmt(r['generate_wait_s_median'], '.2f'):>10} "
                     f"{fmt(r['staleness_max'], '.0f'):>9} {fmt(r['dropped_past_bound'], '.0f'):>7} "
                     f"{fmt(r.get('clipfrac_mean'), '.3f'):>8} {fmt(r['val_accuracy'], '.3f'):>7} {r['samples']:>7}")
    seeds = sorted({r.get("seed") for r in rows})
    if len(seeds) > 1:  # seed noise: each mode's spread over seeds beside the others' means
        lines.append(f"over seeds {seeds}:")
        for name in dict.fromkeys(r["mode"] for r in rows):
            accs = [r["val_accuracy"] for r in rows if r["mode"] == name and r["val_accuracy"] is not None]
            toks = [r["tokens_per_s"] for r in rows if r["mode"] == name]
            if accs:
                lines.append(f"  {name:<12} val acc mean {statistics.mean(accs):.3f} (min {min(accs):.3f}, max "
                             f"{max(accs):.3f}), tokens/s mean {statistics.mean(toks):.1f}")
    sync = [r for r in rows if r["async_generation_ratio"] == 0]
    if sync:
        base = statistics.mean(r["tokens_per_s"] for r in sync)
        means = {name: statistics.mean(r["tokens_per_s"] for r in rows if r["mode"] == name)
                 for name in dict.fromkeys(r["mode"] for r in rows)}
        lines.append("tokens/s vs sync: " + ", ".join(f"{name} {value / base:.2f}x" for name, value in means.items()))
    for r in rows:
        lines.append(f"{r['mode']} (seed {r.get('seed')}) trained response lengths (every step): " + ", ".join(
            f"{k} {v:.3g}" for k, v in r["lengths"].items()))
    lines.append(f"load average (1 min) start {report['load']['start'][0]:.1f}, end {report['load']['end'][0]:.1f}; "
                 f"{report['cpus']} CPUs")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/example_gspo.yaml")
    parser.add_argument("--model", default="builtin:tiny-arith")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", nargs="*", default=list(DEFAULT_MODES), choices=[m for m, _ in MODES],
                        help="the *_decoupled modes: k with the trainer's recompute as proximal policy (AReaL)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[42],
                        help="the run's seed (sampling, data order, init of nothing else); each mode once per seed")
    parser.add_argument("--quick", action="store_true", help="1 + 2 steps at micro shapes, HF rollout: the test's run")
    parser.add_argument("--long-share", type=float, default=LONG_SHARE,
                        help="share of training prompts from the built-in code task (answered at length)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--override", nargs="*", default=[], help="more YAML keys for every mode (key=value)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 2, 1
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    workdir = tempfile.mkdtemp(prefix="bench_async_")
    train_file = mixed_train_file(workdir, 64 if args.quick else 4000, long_share=args.long_share)
    base = build_overrides(args.model, os.path.join(workdir, "output"), args.warmup + args.steps)
    from roll_gspo.config import load_config

    cfg = load_config(args.config, [*base, *mode_overrides(4, train_file, args.quick), *args.override])
    print(f"[bench] modes {args.modes}: {args.warmup} warm-up + {args.steps} measured steps each (work dir "
          f"{workdir})", flush=True)
    loads = {"start": os.getloadavg()}
    init_local_ray(required_cpus(cfg))
    rows = []
    try:
        for seed in args.seeds:  # seeds outermost: a drift in the machine's load spreads over every mode
            for name, ratio in MODES:
                if name in args.modes:
                    rows.append(run_mode(name, ratio, args, base, train_file, seed))
    finally:
        import ray

        ray.shutdown()
    loads["end"] = os.getloadavg()
    report = {"modes": rows, "seeds": args.seeds, "load": loads, "cpus": os.cpu_count(), "workload": {
        "train_file": train_file, "long_share": args.long_share}}
    print_report(format_table(report), report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
