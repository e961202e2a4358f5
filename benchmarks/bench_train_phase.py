#!/usr/bin/env python
"""Where does the training phase's time go, and which layout of the trainer is fastest?

Runs the pipeline's own training code (`ActorTrainWorker.compute_log_probs` and `.train_step`,
DeepSpeed over gloo, no Ray) in several *variants* at once, each a group of plain processes
(world size x threads per rank, ZeRO stage, micro-batch split, dynamic batching), and feeds them
the same rollout batches in turn, A B C A B C ..., so drift of a shared machine hits all alike.
Each call is timed inside rank 0 between barriers; with `--breakdown` the forward, backward
(gradient reduction included) and optimizer-step time of every pass is summed too.

    .venv/bin/python benchmarks/bench_train_phase.py --model 19m --rounds 5 \
        --variant ds2x1:world=2,threads=1 --variant ds1x2:world=1,threads=2

A variant is `name:key=value,...` with keys world, threads, stage (ZeRO), micro
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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

MODEL_19M = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=1536)
VARIANT_KEYS = {"world": int, "threads": int, "stage": int, "micro": int, "gas": int, "dynamic": int, "tokens": int,
                "infer_dynamic": int, "infer_tokens": int}


def build_19m(folder: str) -> str:
    """A random-init Qwen2 of ~19M parameters with the built-in char tokenizer (once)."""
    from roll_gspo import builtin

    def write(tmp):
        builtin.MODEL_SIZES["bench19m"] = MODEL_19M
        builtin.write_base_model(tmp, seed=0, size="bench19m")

    return builtin.build_atomically(folder, write, what="19M bench model")


def parse_variant(text: str) -> Dict[str, Any]:
    name, _, spec = text.partition(":")
    variant = {"name": name, "world": 2, "threads": 1, "stage": 2, "micro": 8, "gas": 2, "dynamic": 0, "tokens": 0,
               "infer_dynamic": 0, "infer_tokens": 0}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in VARIANT_KEYS:
            raise SystemExit(f"variant {name}: unknown key {key!r}; valid: {sorted(VARIANT_KEYS)}")
        variant[key] = VARIANT_KEYS[key](value)
    return variant


def overrides_for(variant: Dict[str, Any], args) -> List[str]:
    responses = args.prompts * args.group
    return [
        f"pretrain={args.model_dir}", f"rollout_batch_size={args.prompts}", f"num_return_sequences_in_group={args.group}",
        f"prompt_length={args.prompt_length}", f"response_length={args.response_length}", "max_steps=1000",
        f"actor_train.world_size={variant['world']}", "~actor_infer.strategy_args.strategy_config.max_model_len",
        f"actor_train.training_args.per_device_train_batch_size={variant['micro']}",
        f"actor_train.training_args.gradient_accumulation_steps={variant['gas']}",
        f"actor_train.strategy_args.strategy_config.zero_optimization.stage={variant['stage']}",
        f"actor_train.use_dynamic_batching_in_train={str(bool(variant['dynamic'])).lower()}",
        f"actor_train.max_tokens_per_microbatch_in_train={variant['tokens']}",
        f"actor_train.use_dynamic_batching_in_infer={str(bool(variant['infer_dynamic'])).lower()}",
        f"actor_train.max_tokens_per_microbatch_in_infer={variant['infer_tokens'] or 'null'}",
        f"actor_train.infer_batch_size={max(1, responses // variant['world'])}",
    ]


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
def rank_main(spec_path: str) -> None:
    import torch

    spec = json.load(open(spec_path))
    from pipelines.common import prepare_models
    from roll_gspo.config import load_config
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.workers.actor_train import ActorTrainWorker

    cfg = load_config(spec["config"], spec["overrides"])
    prepare_models(cfg, ["actor_train"])
    dist_env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    worker = ActorTrainWorker(cfg, dist_env=dist_env, total_optimizer_steps=100000)
    worker.setup()
    rank, world = worker.rank, worker.world_size
    timers = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    if spec["breakdown"]:
        engine = worker.engine

        def timed(name, fn):
            def wrapper(*a, **k):
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timers[name] += time.perf_counter() - start
            return wrapper
        engine.forward = timed("forward", engine.forward)
        engine.backward = timed("backward", engine.backward)
        engine.step = timed("step", engine.step)
    replies = os.fdopen(int(spec["reply_fd"]), "w", buffering=1)
    replies.write(json.dumps({"ready": True, "threads": torch.get_num_threads()}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            break
        batch = Batch({k: v for k, v in torch.load(command["batch_file"]).items()}).chunk(world)[rank]
        for key in timers:
            timers[key] = 0.0
        torch.distributed.barrier()
        start = time.perf_counter()
        batch["old_log_probs"] = worker.compute_log_probs(batch)["old_log_probs"]
        torch.distributed.barrier()
        middle = time.perf_counter()
        scoring = dict(timers)
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
        replies.write(json.dumps({"old_log_probs_s": middle - start, "train_s": end - middle,
                                  "forward_s": timers["forward"] - scoring["forward"],
                                  "backward_s": timers["backward"], "step_s": timers["step"],
                                  "padding_frac": metrics.get("actor/padding_frac")}) + "\n")


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VariantGroup:
    def __init__(self, variant, args, workdir):
        self.variant, self.procs, self.replies, self.workdir = variant, [], [], workdir
        port = free_port()
        for rank in range(variant["world"]):
            read_fd, write_fd = os.pipe()
            spec = {"config": args.config, "overrides": overrides_for(variant, args) + args.override,
                    "breakdown": args.breakdown, "reply_fd": write_fd,
                    "profile": args.profile and f"{args.profile}.{variant['name']}.txt"}
            spec_path = os.path.join(workdir, f"{variant['name']}_{rank}.json")
            json.dump(spec, open(spec_path, "w"))
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(variant["world"]), LOCAL_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(variant["threads"]),
                       PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
                       TORCH_COMPILE_DISABLE="1")
            log = open(os.path.join(workdir, f"{variant['name']}_{rank}.log"), "w")
            self.procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_rank", spec_path],
                                               env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                               pass_fds=(write_fd,), text=True, cwd=REPO_ROOT))
            os.close(write_fd)
            self.replies.append(os.fdopen(read_fd))

    def receive(self):
        out = []
        for reply in self.replies:
            line = reply.readline()
            if not line:
                raise RuntimeError(f"variant {self.variant['name']}: a rank exited; see its log in {self.workdir}")
            out.append(json.loads(line))
        return out[0]

    def send(self, command):
        for proc in self.procs:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()

    def close(self):
        for proc in self.procs:
            try:
                proc.stdin.write(json.dumps({"exit": True}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=60)
            except Exception:
                proc.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--_rank", help=argparse.SUPPRESS)
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
        rank_main(args._rank)
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
    keys = ["old_log_probs_s", "train_s"] + (["forward_s", "backward_s", "step_s"] if args.breakdown else []) + ["padding_frac"]
    print(f"{'variant':<22}" + "".join(f"{k:>16}" for k in keys))
    summary = {}
    for variant in variants:
        rows = results[variant["name"]]
        summary[variant["name"]] = {k: statistics.median(r[k] for r in rows) if rows and rows[0].get(k) is not None
                                    else None for k in keys}
        print(f"{variant['name']:<22}" + "".join(
            f"{summary[variant['name']][k]:>16.3f}" if summary[variant["name"]][k] is not None else f"{'-':>16}"
            for k in keys))
    if args.json:
        json.dump({"variants": variants, "summary": summary, "rounds": results}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
