"""How a GSPO step's cost grows: step time and peak memory against response length and model size,
each beside its FLOP floor.

Two series, each setting a pipeline run of its own (its own Ray, one at a time):

* response length 32, 128, 512, 1024 tokens at 19M parameters;
* model size 1M, 19M, ~100M and 0.5B parameters at 128 tokens.

Every setting runs ``examples/example_gspo_0.5b_cpu.yaml`` (one ZeRO-0 training rank on both cores,
vLLM rollout, old log-probs from vLLM) with 8 prompts x 4 responses, micro-batches of 2
(``--micro-batch``: 1, 2, 4 or 8) and 4 optimizer steps per step, on Qwen2 shapes with random
weights. Below 0.5B the shapes get an 8192-entry vocabulary (the char tokenizer's ids are its
first 100), so a response runs to its cap as at 0.5B (vocabulary 151936): a random policy picks
<eos> about once in 8192 tokens, and with the tokenizer's 100 entries answers would end after ~100
tokens whatever the cap. The parameter column counts that vocabulary.

Per setting: the median wall time of ``pipeline.step()`` over ``--reps`` steps after ``--warmup``,
its generate and train phases, the response tokens generated, each process's peak RSS (the largest
and the sum over the training rank, vLLM, reward worker and driver), and the FLOP floor: FLOPs of
generate + train (2N per prompt and generated token, 6N per trained token, bench_peers.cycle_flops'
floor, as bench_peers.py's; an old-log-prob pass, 2N per token, which bf16 runs add, counts in the
TFLOP column but not in the floor) over the machine's matmul peak in the run's precision, measured here
before and after (torch.matmul, 2048^2, in bf16 also 1024^2, all cores). A second table splits each
step into its phases: generate, the old-log-prob pass, train, the weight sync, the driver's own
work between phases, and the rest (scoring, advantages).

``--dtype bf16`` runs every setting in bf16 (trainer: DeepSpeed bf16 weights on fp32 master weights;
vLLM in bf16; old log-probs then from the trainer's pass, as ``old_logprob_source: auto`` decides)
and takes the bf16 matmul peak for the floor: the issue-40 goal is the 0.5B step within 1.5 x its
floor at the precision it runs in. ``--breakdown`` adds the ranks' own timings
(bench_peers.py --breakdown) as a third table.
``x FLOPs`` and ``x time`` are each against the series' first row: time should grow no faster than
the FLOPs do (a row whose ``x time`` is well above its ``x FLOPs`` is an overhead that grows).

Run: ``.venv/bin/python benchmarks/bench_scaling.py`` (both series, about an hour on a quiet 2-core
machine; the 0.5B row needs ~18 GiB free), ``--series length`` or ``--series size``, ``--skip 0.5b``,
``--reps 3 --warmup 1``, ``--json out.json``; ``--smoke`` (tests): micro shapes, 8- and 16-token
responses, one step each. The 0.5B floor in bf16: ``--series size --skip 1m 19m 100m --dtype bf16
--breakdown`` (about 15 minutes; run it beside ``--dtype fp32`` for the fp32 row).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.bench_peers import (PROMPT_LENGTH, choose_prompts, cycle_flops, dtype_overrides,  # noqa: E402
                                    format_breakdown, measure_matmul_peak, parameter_count)
from benchmarks.harness import (ChildProcess, add_child_flags, child_env, median, print_report,  # noqa: E402
                                read_json, served_as_child)

CONFIG = "example_gspo_0.5b_cpu.yaml"
PROMPTS, GROUP, MICRO_BATCH = 8, 4, 2
BENCH_VOCAB = 8192
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# Qwen2 shapes (head_dim 32 or 64: vLLM's CPU attention), random weights, the char tokenizer.
SHAPES: Dict[str, Dict[str, Any]] = {
    "1m": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=512),
    "19m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1536),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=3072),
    "micro": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=384),
}
SERIES = {
    "length": [("19m", 32), ("19m", 128), ("19m", 512), ("19m", 1024)],
    "size": [("1m", 128), ("19m", 128), ("100m", 128), ("0.5b", 128)],
    "smoke": [("micro", 8), ("micro", 16)],
}


def model_folder(name: str) -> str:
    """The setting's model: the built-in 0.5B shape, or a bench shape built once into the cache."""
    from roll_gspo.builtin.cache import build_atomically, cache_root
    from roll_gspo.builtin.models import resolve_model, write_shaped_model

    if name == "0.5b":
        return resolve_model("builtin:qwen2.5-0.5b-shape")
    shape = {**SHAPES[name], "vocab_size": BENCH_VOCAB, "max_position_embeddings": 4096, "tie_word_embeddings": True}
    folder = os.path.join(cache_root(), "models", f"bench-scaling-{name}-v{BENCH_VOCAB}")
    return build_atomically(folder, lambda tmp: write_shaped_model(tmp, shape, seed=0), what=f"bench model {name}")


def overrides(model_dir: str, data_file: str, response_length: int, output_dir: str, steps: int,
              dtype: str = "fp32", micro_batch: int = MICRO_BATCH) -> List[str]:
    mini = PROMPTS * GROUP // 4  # 4 optimizer steps per step, whatever the micro-batch (parse_args checks it)
    return dtype_overrides(dtype) + [f"pretrain={model_dir}", "eval_steps=0", "save_steps=0", f"output_dir={output_dir}", f"max_steps={steps}",
            "track_with=none", f"rollout_batch_size={PROMPTS}", f"num_return_sequences_in_group={GROUP}",
            f"prompt_length={PROMPT_LENGTH}", f"response_length={response_length}",
            f"actor_train.data_args.file_name=[{data_file}]", f"validation.data_args.file_name=[{data_file}]",
            f"actor_train.training_args.per_device_train_batch_size={micro_batch}",
            f"actor_train.training_args.gradient_accumulation_steps={mini // micro_batch}"]


# ------------------------------------------------------------------------------------------------
# One setting, in a child process with its own Ray
# ------------------------------------------------------------------------------------------------
def child_main(spec_path: str, reply_fd: int) -> None:
    from benchmarks.bench_peers import PipelineRunner

    spec = read_json(spec_path)
    reply = os.fdopen(reply_fd, "w", buffering=1)
    runner = PipelineRunner(spec["overrides"], None, CONFIG)
    if spec.get("breakdown"):
        runner.install_breakdown()
    try:
        steps = []
        for _ in range(spec["steps"]):
            result = runner.cycle()
            steps.append(result)
        reply.write(json.dumps({"steps": steps, "peak_rss_mb": runner.peak_rss()}) + "\n")
    finally:
        runner.close()


def linear_shapes(model_dir: str) -> List[tuple]:
    """(in, out) of every matmul a decoded token passes through: each layer's fused q/k/v, o,
    fused gate/up and down projections, and the LM head (Qwen2/Llama shapes, config.json's)."""
    with open(os.path.join(model_dir, "config.json")) as handle:
        cfg = json.load(handle)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    layer = [(hidden, hidden + 2 * kv * head_dim), (cfg["num_attention_heads"] * head_dim, hidden),
             (hidden, 2 * cfg["intermediate_size"]), (cfg["intermediate_size"], hidden)]
    return layer * layers + [(hidden, cfg["vocab_size"])]


def measure_decode_step(model_dir: str, rows: int, dtype: str = "fp32", reps: int = 5) -> float:
    """Best seconds of one decode step's matmuls alone: `rows` tokens (one per sequence) through
    every linear layer of the model (`linear_shapes`), each with weights of its own so nothing
    stays in cache, on all cores in `dtype`. With a few dozen rows these skinny matmuls neither
    reach the matmul peak nor stream the weights at memory speed: the step's generation cannot
    beat this per decoded token, whatever its FLOPs say (attention and sampling come on top)."""
    import time

    import torch

    from benchmarks.bench_peers import DTYPES

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    kind = getattr(torch, DTYPES[dtype])
    try:
        weights = [torch.randn(n_in, n_out).to(kind) for n_in, n_out in linear_shapes(model_dir)]
        inputs = {w.shape[0]: torch.randn(rows, w.shape[0]).to(kind) for w in weights}
        best = float("inf")
        for _ in range(reps + 1):  # the first round warms the kernels up
            start = time.perf_counter()
            for weight in weights:
                torch.matmul(inputs[weight.shape[0]], weight)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(threads)


def attainable_floor(row: Dict[str, Any], peak_gflops: float) -> Dict[str, float]:
    """The step's floor with generation at its measured decode speed: prefill (2N per prompt
    token) at the matmul peak plus one `decode_step_s` per generated token of each sequence, and
    training (6N per trained token) at the peak. Seconds: generate, train and their sum."""
    sequences = PROMPTS * GROUP
    generate = (2 * row["parameters"] * row["prompt_tokens"] / (peak_gflops * 1e9)
                + row["decode_step_s"] * row["response_tokens"] / sequences)
    train = 6 * row["parameters"] * (row["prompt_tokens"] + row["response_tokens"]) / (peak_gflops * 1e9)
    return {"generate": generate, "train": train, "total": generate + train}


def run_setting(model: str, response_length: int, args, workdir: str) -> Dict[str, Any]:
    model_dir = model_folder(model)
    prompts = choose_prompts(model_dir, PROMPTS)
    name = f"{model}_{response_length}"
    data_file = os.path.join(workdir, f"{name}_prompts.jsonl")
    with open(data_file, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in prompts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_tokens = float(sum(len(tokenizer(r["prompt"])["input_ids"]) for r in prompts) * GROUP)
    steps = args.warmup + args.reps
    spec = {"overrides": overrides(model_dir, data_file, response_length, os.path.join(workdir, name), steps,
                                   args.dtype, args.micro_batch),
            "steps": steps, "breakdown": args.breakdown}
    spec_path = os.path.join(workdir, f"{name}.json")
    child = ChildProcess(f"setting {name}", os.path.abspath(__file__), ["--_child", spec_path], spec, spec_path,
                         os.path.join(workdir, f"{name}.log"), child_env(None, **WORKER_ENV))
    try:
        result = child.receive()
    finally:
        child.close(wait_s=120)
    measured = result["steps"][args.warmup:]
    n_params = parameter_count(model_dir)
    response_tokens = median([s["response_tokens"] for s in measured])
    flops = cycle_flops(n_params, prompt_tokens, response_tokens, old_pass=median(
        [s["phases"]["old_log_probs"] for s in measured]) > 0)
    phases = {p: median([s["phases"].get(p, 0.0) for s in measured])
              for p in ("generate", "score", "old_log_probs", "train", "sync", "driver")}
    phases["train"] -= phases["sync"]  # PipelineRunner's train holds the sync; shown apart here
    rss = result["peak_rss_mb"]
    row = {"model": model, "response_length": response_length, "parameters": n_params,
           "step_s": median([s["cycle"] for s in measured]),
           "generate_s": median([s["phases"]["generate"] for s in measured]),
           "train_s": median([s["phases"]["train"] for s in measured]),
           "response_tokens": response_tokens, "prompt_tokens": prompt_tokens, "flops": flops["total"],
           "floor_flops": flops["floor"],
           "peak_rss_max_mb": max(rss.values()), "peak_rss_sum_mb": sum(rss.values()), "peak_rss_mb": rss,
           "per_step_s": [s["cycle"] for s in measured], "load": os.getloadavg()[0], "phases_s": phases,
           # after the run, its processes gone: the machine to itself, as the matmul peak
           "decode_step_s": measure_decode_step(model_dir, PROMPTS * GROUP, args.dtype)}
    if all("breakdown" in s for s in measured):
        from benchmarks.bench_peers import breakdown_figures

        keys = sorted({k for s in measured for k in s["breakdown"]})
        row["breakdown_s"] = breakdown_figures({k: median([s["breakdown"].get(k, 0.0) for s in measured])
                                                for k in keys}, "pipeline")
    print(f"[bench] {name}: step {row['step_s']:.2f} s, {response_tokens:.0f} response tokens, peak RSS "
          f"{row['peak_rss_max_mb']:.0f} MB (largest process), load {row['load']:.2f}", flush=True)
    return row


def format_report(report: Dict[str, Any]) -> str:
    peak = report["peak_gflops"]
    lines = [f"GSPO step cost ({PROMPTS} prompts x {GROUP}, micro-batches of {report.get('micro_batch', MICRO_BATCH)}, "
             f"{CONFIG}), medians of {report['reps']} steps after "
             f"{report['warmup']} warm-up; {report.get('dtype', 'fp32')} matmul peak {peak:.1f} GFLOP/s "
             f"(before {report['peak_before']:.1f}, "
             f"after {report['peak_after']:.1f}); load average at start {report['load_start']:.2f}, at end "
             f"{report['load_end']:.2f}"]
    header = (f"{'model':>6}{'params':>9}{'resp':>6}{'tokens':>8}{'step s':>9}{'gen s':>8}{'train s':>9}"
              f"{'TFLOP':>8}{'floor s':>9}{'/floor':>8}{'x FLOPs':>9}{'x time':>8}{'RSS max':>9}{'RSS sum':>9}")
    for series, rows in report["series"].items():
        if not rows:
            continue
        lines += ["", f"against {({'length': 'response length', 'size': 'model size'}).get(series, series)} "
                      f"(RSS in MB: the largest process, and all of the run's processes)", header]
        first = rows[0]
        for row in rows:
            floor = row.get("floor_flops", row["flops"]) / (peak * 1e9)
            lines.append(f"{row['model']:>6}{row['parameters'] / 1e6:>8.1f}M{row['response_length']:>6}"
                         f"{row['response_tokens']:>8.0f}{row['step_s']:>9.2f}{row['generate_s']:>8.2f}"
                         f"{row['train_s']:>9.2f}{row['flops'] / 1e12:>8.2f}{floor:>9.2f}{row['step_s'] / floor:>8.2f}"
                         f"{row['flops'] / first['flops']:>9.2f}{row['step_s'] / first['step_s']:>8.2f}"
                         f"{row['peak_rss_max_mb']:>9.0f}{row['peak_rss_sum_mb']:>9.0f}")
    lines.append("floor: FLOPs of generate + train / the matmul peak (an old-log-prob pass, which bf16 runs add, "
                 "is not in it: it counts against the step). x FLOPs, x time: against the series' first row.")
    rows = [row for series in report["series"].values() for row in series if "phases_s" in row]
    if rows:
        lines += ["", "where a step goes (seconds, medians): generate, old-log-prob pass, train (without the sync), "
                      "weight sync, the driver's own work between phases, the rest (scoring, advantages)",
                  f"{'model':>6}{'resp':>6}{'step s':>9}{'gen':>8}{'old lp':>8}{'train':>8}{'sync':>8}{'driver':>8}"
                  f"{'rest':>8}{'floor s':>9}{'train-floor':>12}{'gen-decode':>11}{'/attainable':>12}"]
        shown = set()
        for row in rows:
            if (row["model"], row["response_length"]) in shown:
                continue
            shown.add((row["model"], row["response_length"]))
            p = row["phases_s"]
            rest = row["step_s"] - sum(p[k] for k in ("generate", "old_log_probs", "train", "sync", "driver"))
            # the train phase's own floor: 6N per trained token (bench_peers.cycle_flops' train term)
            train_floor = 6 * row["parameters"] * (row["prompt_tokens"] + row["response_tokens"]) / (peak * 1e9)
            attainable = attainable_floor(row, peak) if "decode_step_s" in row else None
            lines.append(f"{row['model']:>6}{row['response_length']:>6}{row['step_s']:>9.2f}{p['generate']:>8.2f}"
                         f"{p['old_log_probs']:>8.2f}{p['train']:>8.2f}{p['sync']:>8.2f}{p['driver']:>8.2f}"
                         f"{rest:>8.2f}{row.get('floor_flops', row['flops']) / (peak * 1e9):>9.2f}{train_floor:>12.2f}"
                         + (f"{attainable['generate']:>11.2f}{row['step_s'] / attainable['total']:>12.2f}"
                            if attainable else f"{'-':>11}{'-':>12}"))
        if any("decode_step_s" in row for row in rows):
            lines.append("gen-decode: generation at the measured speed of one decode step's matmuls (every linear "
                         f"layer, {PROMPTS * GROUP} rows, this precision, all cores) per generated token, prefill at "
                         "the peak; /attainable: the step over gen-decode + train-floor")
    if any("breakdown_s" in row for row in rows):
        lines += format_breakdown({"rows": {f"{r['model']}/{r['response_length']}": r for r in rows}})
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", nargs="+", default=["length", "size"], choices=["length", "size"])
    parser.add_argument("--skip", nargs="*", default=[], help="models to leave out (e.g. 0.5b)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="every setting in this precision (trainer and vLLM); the floor at its matmul peak")
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH,
                        help="responses per training micro-batch (a divisor of 8; the optimizer steps stay 4)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the ranks' own calls too (bench_peers.py --breakdown): a third table")
    parser.add_argument("--smoke", action="store_true", help="micro shapes, 8 and 16 tokens, 1 step (tests)")
    parser.add_argument("--json", dest="json_path")
    add_child_flags(parser)
    args = parser.parse_args(argv)
    mini = PROMPTS * GROUP // 4
    if args.micro_batch < 1 or mini % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch}: must divide the {mini} responses of an optimizer step "
                     f"(1, 2, 4 or 8)")
    if args.smoke:
        args.series, args.reps, args.warmup = ["smoke"], 1, 0
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if served_as_child(args, child_main):
        return 0
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    workdir = tempfile.mkdtemp(prefix="bench_scaling_")
    print(f"[bench] work dir {workdir} (each setting's log there)", flush=True)
    report: Dict[str, Any] = {"reps": args.reps, "warmup": args.warmup, "load_start": os.getloadavg()[0],
                              "peak_before": measure_matmul_peak(dtype=args.dtype), "series": {}, "dtype": args.dtype,
                              "micro_batch": args.micro_batch}
    done: Dict[tuple, Dict[str, Any]] = {}
    for series in args.series:
        rows = []
        for model, length in SERIES[series]:
            if model in args.skip:
                continue
            if (model, length) not in done:  # 19M at 128 tokens is in both series
                done[(model, length)] = run_setting(model, length, args, workdir)
            rows.append(done[(model, length)])
        report["series"][series] = rows
    report["peak_after"] = measure_matmul_peak(dtype=args.dtype)
    report["peak_gflops"] = max(report["peak_before"], report["peak_after"])
    report["load_end"] = os.getloadavg()[0]
    print_report(format_report(report), report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
