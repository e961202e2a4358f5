#!/usr/bin/env python
"""LoRA vs full fine-tuning on the trainer: peak resident memory and the time of a training step,
for the 19M bench model and a Qwen2.5-0.5B-shaped one (24 layers, hidden 896, vocabulary 151936,
random weights built locally), next to what the placement plan estimates for a training device.

Runs the pipeline's own trainer (`ActorTrainWorker.compute_log_probs` + `.train_step`, DeepSpeed
over gloo, no Ray) through benchmarks/bench_train_phase.py's rank processes, one variant at a time
(a 0.5B full fine-tune holds ~8 GB: variants side by side would not fit a small machine):

    .venv/bin/python benchmarks/bench_lora.py                 # both models, full / LoRA r8 / LoRA r64
    .venv/bin/python benchmarks/bench_lora.py --models 19m --rounds 5 --sync-models

First (`--sync-models`, default the built-in model and the 19M one) the two LoRA syncs into vLLM are
compared in the real pipeline: lora_sync merged vs adapter, the generate and sync phases' medians.

Per variant: a warm-up batch, then --rounds batches; the table shows medians of the scoring pass
(old log-probs) and of the training step (ppo mini-batches: forward, backward, optimizer), and the
largest rank's peak RSS (ru_maxrss, loading included). LoRA targets `all-linear`. The estimate
column is roll_gspo.placement.memory.training_memory for the same config (weights + gradients +
optimizer states; activations left out, they do not depend on LoRA).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from typing import Any, Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.bench_train_phase import VariantGroup, build_19m, make_batches, parse_variant  # noqa: E402
from benchmarks.harness import fmt, median, random_qwen2_model  # noqa: E402

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864)
# Batch sizes per model: the 0.5B one's logits (151936 per token) bound its batch on a 24 GB machine.
BATCHES = {"19m": dict(prompts=16, group=8, response_length=32, micro=16, gas=1),
           "qwen2.5-0.5b": dict(prompts=4, group=4, response_length=16, micro=4, gas=1)}
MODES = {"full": None, "lora_r8": 8, "lora_r64": 64}


def model_folder(name: str) -> str:
    if name == "19m":
        return build_19m(os.path.join(tempfile.gettempdir(), "roll_gspo_bench_19m"))
    from roll_gspo.builtin.models import BUILTIN_MODELS, resolve_model

    if "builtin:qwen2.5-0.5b-shape" in BUILTIN_MODELS:  # the built-in of that shape, where there is one
        return resolve_model("builtin:qwen2.5-0.5b-shape")
    return random_qwen2_model(os.path.join(tempfile.gettempdir(), "roll_gspo_bench_qwen2.5-0.5b-shape"), QWEN25_05B,
                              what="Qwen2.5-0.5B-shaped bench model")


def estimate_gb(folder: str, rank, batch: Dict[str, int]) -> float:
    """The placement plan's estimate of one training rank's weights + gradients + optimizer, in GiB."""
    from roll_gspo.placement.memory import GIB, lora_parameters, shape_of_model_folder, training_memory

    shape = shape_of_model_folder(folder)
    parts = training_memory(shape, dtype="fp32", zero_stage=2, world_size=1, micro_batch=batch["micro"], seq_len=48,
                            trainable=lora_parameters(shape, "all-linear", rank) if rank else None)
    return (parts["weights"] + parts["gradients"] + parts["optimizer"]) / GIB


def run_model(name: str, args) -> List[Dict[str, Any]]:
    folder = model_folder(name)
    shape = BATCHES[name]
    local = copy.copy(args)
    local.model_dir, local.prompts, local.group = folder, shape["prompts"], shape["group"]
    local.response_length, local.prompt_length, local.lengths = shape["response_length"], 16, "full"
    local.breakdown, local.profile = False, None
    batches = make_batches(local, args.warmup + args.rounds)
    workdir = tempfile.mkdtemp(prefix="bench_lora_")
    import torch

    paths = []
    for index, batch in enumerate(batches):
        paths.append(os.path.join(workdir, f"batch_{index}.pt"))
        torch.save(batch, paths[-1])
    rows = []
    for mode, rank in MODES.items():
        if args.modes and mode not in args.modes:
            continue
        variant = parse_variant(f"{mode}:world=1,threads={args.threads},stage=2,micro={shape['micro']},gas={shape['gas']}")
        local.override = list(args.override) + [
            "actor_train.strategy_args.strategy_config.zero_optimization.contiguous_gradients=false",
            f"actor_train.training_args.learning_rate={'1e-3' if rank else '1e-5'}"]
        if rank:
            local.override += ["actor_train.model_args.lora_target=all-linear", f"actor_train.model_args.lora_rank={rank}"]
        group = VariantGroup(variant, local, workdir)
        replies = []
        try:
            group.receive()
            for index, path in enumerate(paths):
                group.send({"batch_file": path, "profile": False})
                reply = group.receive()
                if index >= args.warmup:
                    replies.append(reply)
        finally:
            group.close()
        rows.append({"model": name, "mode": mode, "old_log_probs_s": median(r["old_log_probs_s"] for r in replies),
                     "train_s": median(r["train_s"] for r in replies),
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in replies),
                     "estimate_gb": estimate_gb(folder, rank, shape)})
        print(f"[bench_lora] {name} {mode}: {rows[-1]}", flush=True)
    return rows


def sync_rows(args) -> List[Dict[str, Any]]:
    """The two LoRA syncs into vLLM, in the real pipeline (example_gspo_lora.yaml on each model,
    `--sync-steps` steps after one warm-up, run_pipeline.py in a subprocess each): medians of the
    generate phase (vLLM with merged weights vs with its LoRA kernels), of the sync, and its size."""
    import subprocess

    from benchmarks.harness import build_overrides

    rows = []
    for name in args.sync_models:
        folder = model_folder(name) if name != "builtin" else "builtin:tiny-arith"
        for mode in ("merged", "adapter"):
            out = tempfile.mkdtemp(prefix=f"bench_lora_sync_{mode}_")
            command = [sys.executable, "run_pipeline.py", "--config", "example_gspo_lora.yaml",
                       *build_overrides(folder, out, args.sync_steps + 1, [f"lora_sync={mode}", *args.override])]
            done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
            records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]  # after the warm-up
            rows.append({"model": name, "sync": mode, **{key: median(r.get(key) for r in records) for key in (
                "time/generate_s", "time/sync_s", "sync/megabytes", "time/step_s", "rollout/logprob_gap")}})
            print(f"[bench_lora] sync {name} {mode}: {rows[-1]}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["19m", "qwen2.5-0.5b"], choices=sorted(BATCHES))
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), help="default: all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", default="example_gspo.yaml")
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--sync-models", nargs="*", default=["builtin", "19m"], choices=["builtin", "19m"],
                        help="models of the sync comparison (none: skip it)")
    parser.add_argument("--sync-steps", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    syncs = sync_rows(args)
    if syncs:
        print(f"\nload: {os.getloadavg()[0]:.2f}; lora_sync merged vs adapter, example_gspo_lora.yaml, medians of "
              f"{args.sync_steps} steps")
        print(f"{'model':<10}{'lora_sync':<10}{'generate s':>12}{'sync s':>10}{'sync MB':>10}{'step s':>10}{'logprob gap':>13}")
        for row in syncs:
            print(f"{row['model']:<10}{row['sync']:<10}{fmt(row['time/generate_s']):>12}{fmt(row['time/sync_s']):>10}"
                  f"{fmt(row['sync/megabytes'], '.2f'):>10}{fmt(row['time/step_s']):>10}"
                  f"{fmt(row['rollout/logprob_gap'], '.1e'):>13}")
    rows = [row for name in args.models for row in run_model(name, args)]
    print(f"\nload: {os.getloadavg()[0]:.2f}; 1 rank x {args.threads} threads, ZeRO-2, fp32; medians of {args.rounds} "
          f"rounds (a shared machine: times are upper bounds)")
    print(f"{'model':<14}{'mode':<10}{'old log-probs s':>17}{'train step s':>14}{'peak RSS MB':>13}"
          f"{'plan: w+g+opt GiB':>19}")
    for row in rows:
        print(f"{row['model']:<14}{row['mode']:<10}{fmt(row['old_log_probs_s']):>17}{fmt(row['train_s']):>14}"
              f"{fmt(row['peak_rss_mb'], '.0f'):>13}{fmt(row['estimate_gb'], '.3f'):>19}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"train": rows, "sync": syncs}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
