"""Host memory of each model process of a CPU run, phase by phase, against `--dry-run`'s plan.

Each role's ranks run in plain processes of their own (no Ray, no driver), built exactly as a run
builds them (`ActorTrainWorker` / `ActorInferWorker` from the config, with the environment a Ray
worker of that role gets: `memory_allocator`'s LD_PRELOAD, `system_envs`, the role's threads), and
go through a step's phases on a synthetic batch of the config's size with every response
`response_length` tokens long (the worst case: a random-weight model rarely samples <eos>):

* rollout (`actor_infer`): setup (engine load), generate (rollout_batch_size x G responses),
  weight sync (every weight in buckets of `weight_sync_bucket_mb`, as the trainer sends them),
  generate again;
* training (`actor_train`, all ranks at once over gloo): setup, old log-probs (`compute_log_probs`
  on the rank's shard), train step (`train_step`: ppo_epochs x mini-batches), a second train step.

Per phase: the process's peak resident memory in the phase (`VmHWM`, reset before each phase
through /proc/self/clear_refs) and what it holds after it (`VmRSS`), in GiB; then the host plan's
estimate for the process (roll_gspo.placement.host_memory) and the measured peak over it.

Run (one 0.5B process tree at a time needs ~12 GB free):

    .venv/bin/python benchmarks/bench_host_memory.py --config example_gspo_0.5b_cpu.yaml
    .venv/bin/python benchmarks/bench_host_memory.py --config example_gspo_0.5b_cpu.yaml response_length=1024 \
        --roles actor_train
    .venv/bin/python benchmarks/bench_host_memory.py --config example_gspo.yaml --smoke   # seconds, tests

Overrides after the flags are Hydra's, as for run_pipeline.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness import ChildProcess, add_child_flags, child_env, free_port, read_json, served_as_child  # noqa: E402

GIB = float(1 << 30)
ROLES = ("actor_infer", "actor_train")


# ------------------------------------------------------------------------------------------------
# Memory of this process
# ------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    return float("nan")


class PhaseMemory:
    """Peak (VmHWM, reset per phase) and held (VmRSS) memory of this process, per phase.

    `guard_gib`: a watchdog ends the process (reporting the phases so far and the one it was in)
    when the machine's available memory falls below this, before Ray's or the kernel's OOM killer
    picks some other process of a shared machine."""

    def __init__(self, guard_gib: float = 0.0, reply=None):
        self.phases: Dict[str, Dict[str, float]] = {}
        self.seconds: Dict[str, float] = {}
        self._start = time.perf_counter()
        self._reset()
        if guard_gib > 0:
            import threading

            threading.Thread(target=self._guard, args=(guard_gib, reply), daemon=True).start()

    def _guard(self, guard_gib: float, reply) -> None:
        import psutil

        while True:
            time.sleep(0.2)
            available = psutil.virtual_memory().available / GIB
            if available < guard_gib:
                phases = dict(self.phases)
                phases["aborted"] = {"peak_gib": _status_kb("VmHWM") * 1024 / GIB,
                                     "held_gib": _status_kb("VmRSS") * 1024 / GIB, "available_gib": available}
                if reply is not None:
                    reply({"phases": phases, "seconds": {**self.seconds, "aborted": time.perf_counter() - self._start},
                           "aborted": f"machine's available memory {available:.1f} GiB < guard {guard_gib} GiB"})
                os._exit(3)

    @staticmethod
    def _reset() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current RSS
        except OSError:  # not Linux, or not allowed: peaks are then the process's so far
            pass

    def mark(self, phase: str) -> None:
        """End `phase`: record its peak and what is held now, start the next phase. A phase
        marked again keeps its highest peak, its last held figure and its summed time."""
        peak = _status_kb("VmHWM") * 1024 / GIB
        before = self.phases.get(phase, {})
        self.phases[phase] = {"peak_gib": max(peak, before.get("peak_gib", 0.0)),
                              "held_gib": _status_kb("VmRSS") * 1024 / GIB}
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self._start
        self._reset()
        self._start = time.perf_counter()


# ------------------------------------------------------------------------------------------------
# Synthetic batches of the config's size
# ------------------------------------------------------------------------------------------------
def prompt_rows(cfg, count: int, seed: int = 0) -> List[List[int]]:
    import random

    rng = random.Random(seed)
    length = max(1, cfg.prompt_length // 2)
    return [[rng.randrange(3, 100) for _ in range(length)] for _ in range(count)]


def training_batch(cfg, rows: int, seed: int = 0):
    """`rows` prompt + full-length response rows with what train_step reads (random advantages,
    old log-probs near the policy's: a uniform policy over the vocabulary)."""
    import math

    import torch

    from roll_gspo.distributed.batch import Batch
    from roll_gspo.models.causal_lm import build_sequences

    generator = torch.Generator().manual_seed(seed)
    prompts = prompt_rows(cfg, rows, seed)
    responses = torch.randint(3, 100, (rows, cfg.response_length), generator=generator).tolist()
    input_ids, attention_mask, prompt_lengths, response_mask = build_sequences(prompts, responses, 0)
    vocab = _vocab_size(cfg.actor_train.model_args.model_name_or_path)
    old = torch.full(response_mask.shape, -math.log(vocab))
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "prompt_lengths": prompt_lengths,
                  "response_mask": response_mask, "old_log_probs": old,
                  "advantages": torch.randn(rows, generator=generator)[:, None].expand_as(response_mask).clone()})


def _vocab_size(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as handle:
        return int(json.load(handle)["vocab_size"])


# ------------------------------------------------------------------------------------------------
# Children: one process per rank
# ------------------------------------------------------------------------------------------------
def run_infer(cfg, memory: PhaseMemory, steps: int) -> None:
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.workers.actor_infer import ActorInferWorker

    worker = ActorInferWorker(cfg, dist_env={"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": free_port()})
    memory.mark("start")
    worker.setup()
    memory.mark("setup")
    gen = cfg.actor_infer.generating_args
    prompts = Batch({}, {"prompt_ids": prompt_rows(cfg, cfg.rollout_batch_size // cfg.actor_infer.world_size)})
    for step in range(steps):
        out = worker.generate(prompts, gen)
        memory.mark(f"generate{step + 1}")
        memory.phases[f"generate{step + 1}"]["response_tokens"] = float(sum(len(r) for r in out.meta["response_ids"]))
        if step < steps - 1:
            sync_from_folder(worker, cfg)
            memory.mark(f"weight_sync{step + 1}")


def sync_from_folder(worker, cfg) -> None:
    """Every weight of the model folder into the engine, in the trainer's bucket size, each bucket
    read on its own (a run's bucket arrives in a shared-memory segment of about that size)."""
    from safetensors import safe_open

    folder = cfg.actor_train.model_args.model_name_or_path
    names = []
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), "pt") as handle:
            names += [(file, name, math.prod(handle.get_slice(name).get_shape()) * 4) for name in handle.keys()]
    limit = int(cfg.weight_sync_bucket_mb * (1 << 20))
    buckets, bucket, size = [], [], 0
    for entry in names:
        bucket.append(entry)
        size += entry[2]
        if size >= limit:
            buckets.append(bucket)
            bucket, size = [], 0
    buckets += [bucket] if bucket else []
    strategy = worker.strategy
    strategy.begin_weight_update()
    for bucket in buckets:
        tensors = []
        for file, name, _ in bucket:
            with safe_open(os.path.join(folder, file), "pt") as handle:  # closed again: no mapped pages stay
                tensors.append((name, handle.get_tensor(name).clone()))
        strategy.load_weights(tensors)
        del tensors
    strategy.finish_weight_update()


def run_train(cfg, memory: PhaseMemory, steps: int, rank: int, world: int, port: int) -> None:
    from roll_gspo.workers.actor_train import ActorTrainWorker

    dist_env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    worker = ActorTrainWorker(cfg, dist_env=dist_env, total_optimizer_steps=100)
    memory.mark("start")
    worker.setup()
    memory.mark("setup")
    rows = cfg.rollout_batch_size * cfg.num_return_sequences_in_group // world
    batch = training_batch(cfg, rows, seed=rank)
    worker.compute_log_probs(batch)
    memory.mark("old_log_probs")
    # Within a train step: each micro-batch's forward pass (and loss), then its backward pass with
    # the optimizer step at a mini-batch's end.
    micro_loss, backward_and_step = worker._micro_loss, worker.strategy.backward_and_step

    def forward(*args, **kwargs):
        result = micro_loss(*args, **kwargs)
        memory.mark("forward")
        return result

    def backward(*args, **kwargs):
        result = backward_and_step(*args, **kwargs)
        memory.mark("backward+step")
        return result

    worker._micro_loss, worker.strategy.backward_and_step = forward, backward
    for step in range(steps):
        worker.train_step(batch)
        memory.mark(f"train_step{step + 1}_end")


def child_main(spec_path: str, reply_fd: int) -> None:
    spec = read_json(spec_path)
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def reply(message: Dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    memory = PhaseMemory(spec.get("guard_gib", 0.0), reply)
    from roll_gspo.config import load_config

    cfg = load_config(spec["config"], spec["overrides"])
    from roll_gspo.builtin.models import resolve_model

    for role in (cfg.actor_train, cfg.actor_infer):
        role.model_args.model_name_or_path = resolve_model(role.model_args.model_name_or_path)
    if spec["role"] == "actor_infer":
        run_infer(cfg, memory, spec["steps"])
    else:
        run_train(cfg, memory, spec["steps"], spec["rank"], spec["world"], spec["port"])
    reply({"phases": memory.phases, "seconds": memory.seconds})


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------
def role_env(cfg, name: str) -> Dict[str, str]:
    """The environment a Ray worker of role `name` starts with (allocator, system_envs, threads)."""
    from roll_gspo.distributed.cluster import DEFAULT_WORKER_ENV, worker_env

    role = getattr(cfg, name)
    env = {**DEFAULT_WORKER_ENV, **worker_env(cfg, role)}
    threads = env.pop("OMP_NUM_THREADS", None) or str(max(1, int(role.num_cpus_per_worker)))  # as Ray sets it
    return child_env(threads, **env)


def measure_role(cfg, name: str, args, workdir: str) -> List[Dict[str, Any]]:
    role = getattr(cfg, name)
    world = role.world_size if name == "actor_train" else 1
    port = free_port()
    children = []
    for rank in range(world):
        spec = {"config": args.config, "overrides": args.overrides, "role": name, "steps": args.steps,
                "rank": rank, "world": world, "port": port, "guard_gib": args.guard_gib}
        children.append(ChildProcess(f"{name} rank {rank}", os.path.abspath(__file__),
                                     ["--_child", os.path.join(workdir, f"{name}-{rank}.json")], spec,
                                     os.path.join(workdir, f"{name}-{rank}.json"),
                                     os.path.join(workdir, f"{name}-{rank}.log"), role_env(cfg, name),
                                     niceness=args.niceness))
    results = []
    for child in children:
        result = child.receive()
        results.append(result)
        if result.get("aborted"):
            print(f"[bench] {name}: aborted: {result['aborted']}", flush=True)
        child.close(wait_s=120)
    return results


def host_plan(cfg, host_gib: Optional[float]):
    from roll_gspo.config.plan.model_shape import policy_shape
    from roll_gspo.placement.host_memory import plan_host_memory

    import psutil

    host = host_gib * GIB if host_gib else float(psutil.virtual_memory().total)
    return plan_host_memory(cfg, policy_shape(cfg), host, "--host-memory-gb" if host_gib else "this machine")


def format_report(cfg, measured: Dict[str, List[Dict[str, Any]]], plan) -> str:
    lines = [f"host memory per process, GiB (peak in the phase / held after it); model "
             f"{cfg.actor_train.model_args.model_name_or_path}, {cfg.rollout_batch_size} prompts x "
             f"{cfg.num_return_sequences_in_group}, prompt {cfg.prompt_length} + response {cfg.response_length} tokens"]
    for name, ranks in measured.items():
        estimate = plan.process(name) if plan is not None else None
        for rank, result in enumerate(ranks):
            phases = result["phases"]
            peak = max(p["peak_gib"] for p in phases.values())
            parts = ", ".join(f"{phase} {p['peak_gib']:.2f}/{p['held_gib']:.2f} ({result['seconds'][phase]:.0f} s)"
                              for phase, p in phases.items())
            lines.append(f"{name} rank {rank}: peak {peak:.2f}; {parts}")
            if estimate is not None:
                lines.append(f"  plan: {estimate.total / GIB:.2f} = {estimate.describe()}; measured peak / plan "
                             f"{peak * GIB / estimate.total:.2f}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="example_gspo_0.5b_cpu.yaml")
    parser.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES)
    parser.add_argument("--steps", type=int, default=2, help="generate / train steps per process")
    parser.add_argument("--niceness", type=int, default=5)
    parser.add_argument("--host-memory-gb", type=float, default=None, help="the plan's host size (default: this machine)")
    parser.add_argument("--guard-gib", type=float, default=2.0,
                        help="end a measured process when the machine's available memory falls below this (GiB; "
                             "0: never); its phases so far are reported")
    parser.add_argument("--smoke", action="store_true", help="one step of each role (tests)")
    parser.add_argument("--json", dest="json_path")
    add_child_flags(parser)
    args, overrides = parser.parse_known_args(argv)
    args.overrides = overrides
    if args.smoke:
        args.steps = 1
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if served_as_child(args, child_main):
        return 0
    from roll_gspo.config import load_config

    cfg = load_config(args.config, args.overrides)
    workdir = tempfile.mkdtemp(prefix="bench_host_memory_")
    print(f"[bench] work dir {workdir} (each process's log there)", flush=True)
    measured = {}
    for name in args.roles:
        measured[name] = measure_role(cfg, name, args, workdir)
        print(f"[bench] {name}: " + json.dumps(measured[name]), flush=True)
    try:
        plan = host_plan(cfg, args.host_memory_gb)
    except ImportError:  # no plan module (an older tree): measurements only
        plan = None
    print()
    print(format_report(cfg, measured, plan))
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump({"measured": measured, "overrides": args.overrides, "config": args.config}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
