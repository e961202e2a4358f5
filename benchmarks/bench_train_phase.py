#!/usr/bin/env python
"""Where does the training phase's time go, and which layout of the trainer is fastest?

Runs the pipeline's own training code (`ActorTrainWorker.compute_log_probs` and `.train_step`,
DeepSpeed or FSDP2 over gloo, no Ray) in several *variants* at once, each a group of plain processes
(world size x threads per rank, engine, ZeRO stage, micro-batch split, dynamic batching), and feeds them
the same rollout batches in turn, A B C A B C ..., so drift of a shared machine hits all alike.
Each call is timed inside rank 0 between barriers; with `--breakdown` the forward, backward
(gradient reduction included) and optimizer-step time of every pass is summed too. Each rank
reports its peak resident memory (`ru_maxrss`: loading included); the table shows the largest rank's.

    .venv/bin/python benchmarks/bench_train_phase.py --model 19m --rounds 5 \
        --variant ds2x1:world=2,threads=1 --variant ds1x2:world=1,threads=2
    .venv/bin/python benchmarks/bench_train_phase.py --model 19m --rounds 5 --variant zero2:stage=2 \
        --variant zero3:stage=3 --variant fsdp2:engine=fsdp2 --variant fsdp2_keep:engine=fsdp2,reshard=0

A variant is `name:key=value,...` with keys engine (deepspeed, or fsdp2: `fsdp2_train` with its
defaults), reshard (FSDP2's reshard_after_forward, 0/1), world, threads, stage (ZeRO), micro
(per_device_train_batch_size), gas (gradient_accumulation_steps; a mini-batch is micro x gas x
world responses, one optimizer step: keep it equal across variants), dynamic (0/1),
tokens (max_tokens_per_microbatch_in_train), infer_dynamic (0/1), infer_tokens. `--model` is a
folder, `tiny` (the built-in 1M model) or `19m` (hidden 512, 6 layers, built under /tmp once).
Batches: --prompts x --group responses, response lengths all --response-length (`--lengths
full`) or uniform in 1..--response-length (`--lengths mixed`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness import (  # noqa: E402  (needs REPO_ROOT on sys.path)
    ChildProcess, PhaseClock, child_env, fmt, free_port, median, peak_rss_mb, random_qwen2_model, rank_env, read_json,
    serve)

MODEL_19M = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=1536)
VARIANT_KEYS = {"engine": str, "reshard": int, "world": int, "threads": int, "stage": int, "micro": int, "gas": int,
                "dynamic": int, "tokens": int, "infer_dynamic": int, "infer_tokens": int}
ENGINES = ("deepspeed", "fsdp2")


def build_19m(folder: str) -> str:
    """A random-init Qwen2 of ~19M parameters with the built-in char tokenizer (once)."""
    return random_qwen2_model(folder, MODEL_19M, what="19M bench model")


def parse_variant(text: str) -> Dict[str, Any]:
    name, _, spec = text.partition(":")
    variant = {"name": name, "engine": "deepspeed", "reshard": 1, "world": 2, "threads": 1, "stage": 2, "micro": 8,
               "gas": 2, "dynamic": 0, "tokens": 0, "infer_dynamic": 0, "infer_tokens": 0}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in VARIANT_KEYS:
            raise SystemExit(f"variant {name}: unknown key {key!r}; valid: {sorted(VARIANT_KEYS)}")
        variant[key] = VARIANT_KEYS[key](value)
    if variant["engine"] not in ENGINES:
        raise SystemExit(f"variant {name}: engine {variant['engine']!r}; valid: {ENGINES}")
    return variant


def engine_overrides(variant: Dict[str, Any]) -> List[str]:
    """The variant's training engine: DeepSpeed at its ZeRO stage, or FSDP2 (its strategy_config
    replaces the example's DeepSpeed one)."""
    if variant["engine"] == "fsdp2":
        reshard = "true" if variant["reshard"] else "false"
        return ["actor_train.strategy_args.strategy_name=fsdp2_train",
                f"actor_train.strategy_args.strategy_config={{reshard_after_forward: {reshard}}}"]
    return [f"actor_train.strategy_args.strategy_config.zero_optimization.stage={variant['stage']}"]


def overrides_for(variant: Dict[str, Any], args) -> List[str]:
    responses = args.prompts * args.group
    return [
        f"pretrain={args.model_dir}", f"rollout_batch_size={args.prompts}", f"num_return_sequences_in_group={args.group}",
        f"prompt_length={args.prompt_length}", f"response_length={args.response_length}", "max_steps=1000",
        f"actor_train.world_size={variant['world']}", "~actor_infer.strategy_args.strategy_config.max_model_len",
        f"actor_train.training_args.per_device_train_batch_size={variant['micro']}",
        f"actor_train.training_args.gradient_accumulation_steps={variant['gas']}",
        f"actor_train.use_dynamic_batching_in_train={str(bool(variant['dynamic'])).lower()}",
        f"actor_train.max_tokens_per_microbatch_in_train={variant['tokens']}",
        f"actor_train.use_dynamic_batching_in_infer={str(bool(variant['infer_dynamic'])).lower()}",
        f"actor_train.max_tokens_per_microbatch_in_infer={variant['infer_tokens'] or 'null'}",
        f"actor_train.infer_batch_size={max(1, responses // variant['world'])}",
    ] + engine_overrides(variant)


def make_batches(args, count: int):
    """`count` rollout-like batches: arithmetic prompts, random response tokens, advantages."""
    import torch

    from roll_gspo.builtin.arith import make_arith_samples
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.models.causal_lm import build_sequences
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    batches = []
    for index in range(count):
        g = torch.Generator().manual_seed(index)
        rows = make_arith_samples(args.prompts, seed=index)
        prompts = [tokenizer(r["prompt"])["input_ids"][:args.prompt_length] for r in rows for _ in range(args.group)]
        if args.lengths == "full":
            lengths = [args.response_length] * len(prompts)
        else:
            lengths = torch.randint(1, args.response_length + 1, (len(prompts),), generator=g).tolist()
        responses = [torch.randint(5, len(tokenizer), (n,), generator=g).tolist() for n in lengths]
        input_ids, attention, prompt_lengths, response_mask = build_sequences(prompts, responses, tokenizer.pad_token_id)
        batch = Batch({"input_ids": input_ids, "attention_mask": attention, "prompt_lengths": prompt_lengths,
                       "response_mask": response_mask})
        batch["advantages"] = torch.randn(len(prompts), 1, generator=g).expand_as(response_mask).clone()
        batches.append(batch.tensors)
    return batches


# ------------------------------------------------------------------------------------------------
# One rank (a child process)
# ------------------------------------------------------------------------------------------------
def rank_main(spec_path: str, reply_fd: int) -> None:
    import torch

    spec = read_json(spec_path)
    from pipelines.common import prepare_models
    from roll_gspo.config import load_config
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.workers.actor_train import ActorTrainWorker

    cfg = load_config(spec["config"], spec["overrides"])
    cfg = prepare_models(cfg, ["actor_train"])
    dist_env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    worker = ActorTrainWorker(cfg, dist_env=dist_env, total_optimizer_steps=100000)
    worker.setup()
    rank, world = worker.rank, worker.world_size
    clock = PhaseClock()
    if spec["breakdown"]:
        clock.wrap(worker.engine, "forward", "forward")
        # DeepSpeed's engine backs up and steps; FSDP2's strategy does (its engine is the model).
        stepper = worker.engine if hasattr(worker.engine, "backward") else worker.strategy
        for method in ("backward", "step"):
            clock.wrap(stepper, method, method)

    def train(command):
        batch = Batch({k: v for k, v in torch.load(command["batch_file"]).items()}).chunk(world)[rank]
        clock.take()  # from zero for this batch
        torch.distributed.barrier()
        start = time.perf_counter()
        batch["old_log_probs"] = worker.compute_log_probs(batch)["old_log_probs"]
        torch.distributed.barrier()
        middle = time.perf_counter()
        scoring = dict(clock.seconds)
        if spec["profile"] and rank == 0 and command.get("profile"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                metrics = worker.train_step(batch)
            with open(spec["profile"], "w") as out:
                out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        else:
            metrics = worker.train_step(batch)
        torch.distributed.barrier()
        end = time.perf_counter()
        timers = clock.take()
        return {"old_log_probs_s": middle - start, "train_s": end - middle,
                "forward_s": timers.get("forward", 0.0) - scoring.get("forward", 0.0),
                "backward_s": timers.get("backward", 0.0), "step_s": timers.get("step", 0.0),
                "padding_frac": metrics.get("actor/padding_frac"), "peak_rss_mb": peak_rss_mb()}

    serve(reply_fd, {"ready": True, "threads": torch.get_num_threads()}, train)


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------
class VariantGroup:
    """A variant's ranks, one child process each (`--_rank`), fed the same commands."""

    def __init__(self, variant, args, workdir):
        self.variant, self.ranks = variant, []
        port = free_port()
        spec = {"config": args.config, "overrides": overrides_for(variant, args) + args.override,
                "breakdown": args.breakdown, "profile": args.profile and f"{args.profile}.{variant['name']}.txt"}
        for rank in range(variant["world"]):
            name = f"{variant['name']}_{rank}"
            spec_path = os.path.join(workdir, f"{name}.json")
            env = child_env(variant["threads"], TORCH_COMPILE_DISABLE="1", **rank_env(rank, variant["world"], port))
            self.ranks.append(ChildProcess(f"variant {variant['name']} rank {rank}", os.path.abspath(__file__),
                                           ["--_rank", spec_path], spec, spec_path,
                                           os.path.join(workdir, f"{name}.log"), env, cwd=REPO_ROOT))

    def receive(self):
        """Rank 0's reply (timed between barriers), with the largest rank's peak memory."""
        replies = [rank.receive() for rank in self.ranks]
        return {**replies[0], "peak_rss_mb": max((r.get("peak_rss_mb") or 0.0) for r in replies)}

    def send(self, command):
        for rank in self.ranks:
            rank.send(command)

    def close(self):
        for rank in self.ranks:
            rank.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--_rank", help=argparse.SUPPRESS)
    parser.add_argument("--_reply_fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", default="example_gspo.yaml")
    parser.add_argument("--model", default="19m")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--override", action="append", default=[], help="extra config override for every variant")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--lengths", choices=["full", "mixed"], default="full")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--profile", help="write rank 0's torch.profiler table of the last round's train call "
                                          "to PROFILE.<variant>.txt")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args._rank:
        rank_main(args._rank, args._reply_fd)
        return 0
    if args.model == "19m":
        args.model_dir = build_19m(os.path.join(tempfile.gettempdir(), "roll_gspo_bench_19m"))
    elif args.model == "tiny":
        from roll_gspo.builtin.models import resolve_model
        args.model_dir = resolve_model("builtin:tiny-arith")
    else:
        args.model_dir = args.model
    variants = [parse_variant(v) for v in args.variant] or [parse_variant("zero2_2x1:")]
    batches = make_batches(args, args.warmup + args.rounds)
    results: Dict[str, List[Dict[str, float]]] = {v["name"]: [] for v in variants}
    workdir = tempfile.mkdtemp(prefix="bench_train_")  # the ranks' logs stay there
    if True:
        groups = [VariantGroup(v, args, workdir) for v in variants]
        try:
            for group in groups:
                group.receive()
            import torch
            for index, batch in enumerate(batches):
                path = os.path.join(workdir, f"batch_{index}.pt")
                torch.save(batch, path)
                for group in groups:  # in turn: A B C A B C ...
                    group.send({"batch_file": path, "profile": index == len(batches) - 1})
                    reply = group.receive()
                    if index >= args.warmup:
                        results[group.variant["name"]].append(reply)
        finally:
            for group in groups:
                group.close()
    print(f"load: {os.getloadavg()[0]:.2f}  model: {args.model_dir}  batch: {args.prompts} x {args.group}, "
          f"responses {args.lengths} <= {args.response_length}; medians of {args.rounds} rounds")
    keys = ["old_log_probs_s", "train_s"] + (["forward_s", "backward_s", "step_s"] if args.breakdown else []) + \
        ["padding_frac", "peak_rss_mb"]
    print(f"{'variant':<22}" + "".join(f"{k:>16}" for k in keys))
    summary = {}
    for variant in variants:
        rows = results[variant["name"]]
        summary[variant["name"]] = {k: median([r.get(k) for r in rows]) for k in keys}
        print(f"{variant['name']:<22}" + "".join(f"{fmt(summary[variant['name']][k]):>16}" for k in keys))
    if args.json:
        json.dump({"variants": variants, "summary": summary, "rounds": results}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
