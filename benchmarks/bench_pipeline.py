#!/usr/bin/env python
"""How much does the RLVR pipeline cost on top of its engines?

In one run, on the same tiny model and the same batches, step by step:

1. the real pipeline (``TrainerLoop`` fed by ``PromptGroupSource``, from a YAML, Ray actors, vLLM rollout, DeepSpeed ranks)
   runs W warm-up + N measured steps; every phase time of every step is kept, with the wall time
   of each ``step()`` call. The prompts given to the rollout and the batch given to the trainer
   are recorded on the way (a spy on ``Cluster.dispatch``, nothing in the pipeline changes);
2. after each step, optionally (``--probe``, on by default), the same work is timed *inside* the
   pipeline's actors (``__ray_call__``), which separates Ray dispatch/serialisation from the
   engines' own time;
3. then the raw components replay that step's inputs, each in its own process started once
   before the first step, with the thread settings read from the pipeline's own actors:
   * raw vLLM: an in-process ``vllm.LLM`` built with VllmStrategy's engine arguments, generating
     the step's prompts with the same sampling parameters;
   * raw DeepSpeed: ``world_size`` plain processes (torch.distributed over gloo, no Ray) each
     building ``DeepSpeedStrategy`` and doing the training phase's work on its shard of the step's
     batch: the old-log-prob forward pass (when the pipeline's old log-probs come from the trainer), then
     ppo_epochs x mini-batches of forward / GSPO ``policy_loss`` / backward / step.
   Interleaving puts each raw figure next to the pipeline step it is compared with, so a machine
   that speeds up or slows down during the run moves both sides alike;
4. a table of medians, the ratios ``pipeline step / (raw generate + raw train)`` and
   ``sync / step`` against their targets, and the same figures as JSON (``--json``).

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 10] [--warmup 2] [--json out.json]

See benchmarks/README.md for what each figure means.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness import (  # noqa: E402  (needs REPO_ROOT on sys.path)
    ChildProcess, build_overrides, child_env, fmt, free_port, init_local_ray, median, print_report, rank_env,
    read_json, required_cpus, serve)

# Targets: the pipeline may cost at most 15% over its engines run alone, and the weight sync at
# most 5% of a step.
TARGET_STEP_OVER_RAW = 1.15
TARGET_SYNC_OVER_STEP = 0.05
PHASES = ("generate", "reward", "reference", "old_log_probs", "advantages", "train", "sync")


# ------------------------------------------------------------------------------------------------
# Pure helpers (tested in tests/test_benchmarks.py, with `median` and `build_overrides` from the harness)
# ------------------------------------------------------------------------------------------------
def phase_medians(step_metrics: Sequence[Dict[str, float]], wall: Sequence[float] = ()) -> Dict[str, float]:
    """Median seconds per pipeline phase over steps (`time/<phase>_s` keys), plus `step` (the
    pipeline's own sum of phases) and `step_wall` (the wall time of each `step()` call)."""
    out: Dict[str, float] = {}
    for phase in PHASES + ("step",):
        value = median([m[f"time/{phase}_s"] for m in step_metrics if f"time/{phase}_s" in m])
        if value is not None:
            out[phase] = value
    if wall:
        out["step_wall"] = median(wall)
    return out


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def verdict(value: Optional[float], target: float) -> str:
    """PASS when value <= target, FAIL above it, N/A when there is no value."""
    if value is None:
        return "N/A"
    return "PASS" if value <= target + 1e-12 else "FAIL"


def compute_ratios(pipeline_step: Optional[float], raw_generate: Optional[float], raw_train: Optional[float],
                   sync: Optional[float], step_for_sync: Optional[float] = None,
                   target_step: float = TARGET_STEP_OVER_RAW,
                   target_sync: float = TARGET_SYNC_OVER_STEP) -> Dict[str, Dict[str, Any]]:
    """The two headline ratios with their targets and verdicts.

    step_over_raw = pipeline_step / (raw_generate + raw_train);
    sync_over_step = sync / step_for_sync (default: pipeline_step).
    """
    raw_total = None if raw_generate is None or raw_train is None else raw_generate + raw_train
    step_over_raw = ratio(pipeline_step, raw_total)
    sync_over_step = ratio(sync, step_for_sync if step_for_sync is not None else pipeline_step)
    return {
        "step_over_raw": {"value": step_over_raw, "target": target_step,
                          "verdict": verdict(step_over_raw, target_step)},
        "sync_over_step": {"value": sync_over_step, "target": target_sync,
                           "verdict": verdict(sync_over_step, target_sync)},
    }


def format_table(report: Dict[str, Any]) -> str:
    """The human-readable summary of a report (the dict written by --json)."""
    pipe = report["pipeline"]["median_s"]
    per_step = report["pipeline"].get("per_step", {})
    raw = report.get("raw", {})
    probe = report.get("probe", {})
    lines = [
        f"GSPO pipeline benchmark: {report['setup']['description']}",
        f"medians over {report['setup']['measured_steps']} measured steps "
        f"(after {report['setup']['warmup_steps']} warm-up); seconds",
    ]
    loads = report["setup"].get("load_average_1_5_15min") or {}
    if loads:
        lines.append(f"1-min load average on {report['setup'].get('cpu_count')} CPUs: "
                     + ", ".join(f"{k.replace('_', ' ')} {v[0]:.2f}" for k, v in loads.items()))
    lines += [
        "",
        f"{'figure':<44}{'median':>9}   per measured step",
    ]

    def row(label: str, value: Optional[float], values: Sequence[float] = ()) -> None:
        lines.append(f"{label:<44}{fmt(value):>9}   " + " ".join(f"{v:.3f}" for v in values))

    for phase in PHASES:
        if phase in pipe:
            row(f"pipeline {phase}", pipe[phase], per_step.get(phase, ()))
    row("pipeline step (sum of phases, time/step_s)", pipe.get("step"), per_step.get("step", ()))
    row("pipeline step (wall time of step())", pipe.get("step_wall"), per_step.get("step_wall", ()))
    if probe:
        lines.append("")
        row("in-actor generate (no Ray transfer)", probe.get("generate"), probe.get("per_step", {}).get("generate", ()))
        if probe.get("old_log_probs") is not None:
            row("in-actor old log-probs", probe.get("old_log_probs"),
                probe.get("per_step", {}).get("old_log_probs", ()))
        row("in-actor train", probe.get("train"), probe.get("per_step", {}).get("train", ()))
    lines.append("")
    row("raw vLLM generate", raw.get("generate"), raw.get("per_step", {}).get("generate", ()))
    row("raw DeepSpeed train (old log-probs + update)", raw.get("train"), raw.get("per_step", {}).get("train", ()))
    if raw.get("old_log_probs") is not None:
        row("  of which old log-probs", raw.get("old_log_probs"), raw.get("per_step", {}).get("old_log_probs", ()))
    row("  of which update", raw.get("update"), raw.get("per_step", {}).get("update", ()))
    lines.append("")
    lines.append(f"{'ratio':<44}{'value':>9}   {'target':>8}   verdict")
    labels = {"step_over_raw": "pipeline step / (raw generate + raw train)", "sync_over_step": "sync / step",
              "step_over_in_actor": "pipeline step / in-actor (gen+old lp+train)"}
    for key, label in labels.items():
        if key not in report["ratios"]:
            continue
        entry = report["ratios"][key]
        value = entry["value"]
        if key == "sync_over_step":
            shown = fmt(value, ".1%")
            target = f"<= {100 * entry['target']:.0f}%"
        else:
            shown = fmt(value)
            target = "-" if entry["target"] is None else f"<= {entry['target']:.2f}"
        lines.append(f"{label:<44}{shown:>9}   {target:>8}   {entry['verdict']}")
    return "\n".join(lines)


def per_step_lists(step_metrics: Sequence[Dict[str, float]], wall: Sequence[float]) -> Dict[str, List[float]]:
    out = {phase: [m[f"time/{phase}_s"] for m in step_metrics if f"time/{phase}_s" in m] for phase in PHASES}
    out = {k: v for k, v in out.items() if v}
    out["step"] = [m["time/step_s"] for m in step_metrics]
    out["step_wall"] = list(wall)
    return out


# ------------------------------------------------------------------------------------------------
# Raw components: child processes (`--_worker vllm|train`) that load their engine once, then answer
# one JSON command per line on stdin with one JSON reply per line on a pipe (`--_reply_fd`), so the
# driver can run them step by step between the pipeline's steps.
# ------------------------------------------------------------------------------------------------
def _thread_facts() -> Dict[str, Any]:
    import torch

    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def raw_vllm_worker(spec: Dict[str, Any], reply_fd: int) -> None:
    """vllm.LLM in this process; each command {"prompts": [...]} is one timed generate call."""
    from vllm import LLM, SamplingParams

    threads_before = _thread_facts()
    start = time.perf_counter()
    llm = LLM(**spec["engine_args"])
    startup = time.perf_counter() - start
    params = SamplingParams(**spec["sampling"])

    def generate(command):
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in command["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {"generate_s": seconds, "tokens": sum(len(c.token_ids) for out in outputs for c in out.outputs),
                "threads": _thread_facts()}

    serve(reply_fd, {"startup_s": startup, "threads_at_start": threads_before}, generate)


def raw_train_worker(spec: Dict[str, Any], reply_fd: int) -> None:
    """One DeepSpeed rank (env RANK/WORLD_SIZE/MASTER_*): each command {"batch_file": path} is the
    pipeline's training-phase work on this rank's shard of that batch, with DeepSpeedStrategy and
    policy_loss, no Ray."""
    import torch

    from pipelines.common import prepare_models
    from roll_gspo.algorithms import policy_loss
    from roll_gspo.config import load_config
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.models.causal_lm import micro_batches, response_token_log_probs
    from roll_gspo.strategies.deepspeed_strategy import DeepSpeedStrategy

    cfg = load_config(spec["config"], spec["overrides"])
    cfg = prepare_models(cfg, ["actor_train"])
    role, args = cfg.actor_train, cfg.actor_train.training_args
    temperature = cfg.actor_infer.generating_args.temperature or 1.0
    strategy = DeepSpeedStrategy(role, train=True, total_optimizer_steps=spec["total_optimizer_steps"], seed=cfg.seed)
    engine, rank, world = strategy.engine, strategy.rank, strategy.world_size
    per_rank_mini = args.per_device_train_batch_size * args.gradient_accumulation_steps

    def log_probs_of(batch):
        return response_token_log_probs(engine, batch["input_ids"], batch["attention_mask"], batch["prompt_lengths"],
                                        batch["response_mask"].shape[1], temperature)[0]

    def train(command):
        batch = Batch(torch.load(command["batch_file"])).chunk(world)[rank]
        torch.distributed.barrier()
        start = time.perf_counter()
        if spec["old_logprob_source"] == "trainer":
            with torch.no_grad():
                engine.eval()
                batch["old_log_probs"] = torch.cat([
                    log_probs_of(batch.select(range(c.start, c.stop)))
                    for c in micro_batches(len(batch), role.infer_batch_size)])
                engine.train()
        torch.distributed.barrier()
        middle = time.perf_counter()
        generator = torch.Generator().manual_seed(cfg.seed + int(engine.global_steps))
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator).tolist()
            for first in range(0, len(batch), per_rank_mini):
                mini = batch.select(order[first:first + per_rank_mini])
                mask = mini["response_mask"]
                num_seqs, num_tokens = strategy.all_reduce_sum([float((mask.sum(-1) > 0).sum()), float(mask.sum())])
                chunks = micro_batches(len(mini), args.per_device_train_batch_size)
                for index, chunk in enumerate(chunks):
                    micro = mini.select(range(chunk.start, chunk.stop))
                    loss, _ = policy_loss(
                        log_probs_of(micro), micro["old_log_probs"], micro["advantages"], micro["response_mask"],
                        importance_sampling=cfg.importance_sampling, clip_low=cfg.pg_clip_low,
                        clip_high=cfg.pg_clip_high, loss_agg_mode=cfg.loss_agg_mode,
                        dual_clip_c=cfg.dual_clip_c if cfg.dual_clip_loss else None,
                        num_seqs=num_seqs, num_tokens=num_tokens, norm_length=cfg.loss_norm_length)
                    strategy.backward_and_step(loss, boundary=index == len(chunks) - 1)
        torch.distributed.barrier()
        end = time.perf_counter()
        return {"old_log_probs_s": middle - start, "update_s": end - middle, "train_s": end - start,
                "optimizer_steps": int(engine.global_steps)}

    serve(reply_fd, {"threads": _thread_facts()}, train)


class RawEngines:
    """Raw vLLM (one process) and raw DeepSpeed (`world_size` processes over gloo), loaded once and
    then driven one recorded batch at a time, so each raw measurement sits right next to the
    pipeline step whose inputs it replays."""

    def __init__(self, args, cfg, overrides: List[str], vllm_threads: Optional[str], train_threads: Optional[str],
                 workdir: str):
        from roll_gspo.strategies.vllm_strategy import sampling_kwargs, vllm_engine_args

        self.workdir = workdir
        gen = cfg.actor_infer.generating_args
        self.engine_args = vllm_engine_args(cfg.actor_infer, max_model_len=cfg.prompt_length + cfg.response_length,
                                            seed=cfg.seed)
        self.sampling = sampling_kwargs(gen, gen.num_return_sequences)
        responses = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
        train_spec = {"config": args.config, "overrides": overrides, "old_logprob_source": cfg.old_logprob_source,
                      "total_optimizer_steps": cfg.max_steps * cfg.ppo_epochs * (responses // cfg.mini_batch_size())}
        self.processes: List[ChildProcess] = []
        try:
            self.vllm = self._start("vllm", {"engine_args": self.engine_args, "sampling": self.sampling},
                                    vllm_threads, {}, "raw_vllm.log")
            world, port = cfg.actor_train.world_size, free_port()
            self.trainers = [self._start("train", train_spec, train_threads, rank_env(rank, world, port),
                                         f"raw_train_rank{rank}.log") for rank in range(world)]
            self.vllm_ready = self.vllm.receive()
            self.train_ready = [t.receive() for t in self.trainers]
        except BaseException:
            self.close()
            raise
        self.batches = 0

    def _start(self, mode: str, spec: Dict[str, Any], omp_threads: Optional[str], env: Dict[str, str],
               log_name: str) -> ChildProcess:
        from roll_gspo.distributed.cluster import DEFAULT_WORKER_ENV

        log_path = os.path.join(self.workdir, log_name)
        spec_path = log_path + ".spec.json"
        # The pipeline's worker environment, with the thread count of the actor it stands for.
        env = child_env(omp_threads, DEFAULT_WORKER_ENV, **env)
        self.processes.append(ChildProcess(f"raw {mode}", os.path.abspath(__file__),
                                           ["--_worker", mode, "--_spec", spec_path], spec, spec_path, log_path, env,
                                           cwd=REPO_ROOT, timeout=1800))
        return self.processes[-1]

    def generate(self, prompts: List[List[int]]) -> Dict[str, Any]:
        return self.vllm.request({"prompts": prompts})

    def train(self, tensors: Dict[str, Any]) -> Dict[str, Any]:
        import torch

        batch_file = os.path.join(self.workdir, f"train_batch_{self.batches}.pt")
        self.batches += 1
        torch.save(tensors, batch_file)
        for trainer in self.trainers:
            trainer.send({"batch_file": batch_file})
        return [trainer.receive() for trainer in self.trainers][0]  # timed between barriers: rank 0's

    def close(self) -> None:
        for process in self.processes:
            process.close()


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------
def _actor_threads(worker) -> Dict[str, Any]:
    import ray

    return ray.get(worker.__ray_call__.remote(lambda self: _thread_facts()))


def _probe_generate(self, prompts, gen):
    start = time.perf_counter()
    self.generate(prompts, gen)
    return time.perf_counter() - start


def _probe_train(self, shard, with_old_log_probs):
    start = time.perf_counter()
    if with_old_log_probs:
        shard["old_log_probs"] = self.compute_log_probs(shard)["old_log_probs"]
    middle = time.perf_counter()
    self.train_step(shard)
    return middle - start, time.perf_counter() - middle


def run_interleaved(args, cfg, overrides: List[str], workdir: str) -> Dict[str, Any]:
    """W + N pipeline steps, each followed by (unless --no-probe) the same work timed inside the
    pipeline's actors and (unless --skip-raw) the raw engines replaying the step's inputs. Returns
    the pipeline's metrics and wall times, the recorded inputs, thread facts, probe and raw timings."""
    import ray

    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop

    init_local_ray(required_cpus(cfg), log_to_driver=args.verbose)
    start = time.perf_counter()
    pipeline = TrainerLoop(cfg, make_prompt_group_source)
    startup = time.perf_counter() - start
    # `auto` resolved by the pipeline: the raw trainer and the probe do the old-log-prob pass only
    # when the pipeline does.
    cfg.old_logprob_source = pipeline.old_logprobs.source
    recorded: Dict[str, List[Any]] = {"prompts": [], "train": []}
    raw_engines = None
    raw_steps: List[Dict[str, Any]] = []
    try:
        for cluster in (pipeline.actor_infer, pipeline.actor_train):
            original = cluster.dispatch

            def spy(method, batch, _original=original, **kwargs):
                if method == "generate":
                    recorded["prompts"].append([list(p) for p in batch["prompt_ids"]])
                elif method == "train_step":
                    recorded["train"].append({k: v.clone() for k, v in batch.tensors.items()})
                return _original(method, batch, **kwargs)

            cluster.dispatch = spy
        threads = {"actor_infer": _actor_threads(pipeline.actor_infer.workers[0]),
                   "actor_train": [_actor_threads(w) for w in pipeline.actor_train.workers]}
        if not args.skip_raw:
            # The raw processes get the thread settings of the actors they stand for.
            vllm_threads = args.vllm_threads or threads["actor_infer"]["OMP_NUM_THREADS"]
            train_threads = args.train_threads or threads["actor_train"][0]["OMP_NUM_THREADS"]
            print(f"[bench] starting raw vLLM (OMP_NUM_THREADS={vllm_threads}) and raw DeepSpeed x "
                  f"{cfg.actor_train.world_size} (OMP_NUM_THREADS={train_threads})", flush=True)
            raw_engines = RawEngines(args, cfg, overrides, vllm_threads, train_threads, workdir)
        metrics, wall, probes = [], [], []
        total = args.warmup + args.steps
        for step in range(1, total + 1):
            start = time.perf_counter()
            result = pipeline.step(step)
            wall.append(time.perf_counter() - start)
            metrics.append(result)
            line = f"  step {step}/{total} ({'warm-up' if step <= args.warmup else 'measured'}): pipeline {wall[-1]:.3f} s"
            if args.probe and step > args.warmup:
                probes.append(_probe_step(pipeline, cfg, recorded["prompts"][-1], recorded["train"][-1]))
                line += "; in-actor " + ", ".join(f"{k} {v:.3f}" for k, v in probes[-1].items() if v is not None)
            if raw_engines is not None:
                raw_steps.append({"generate": raw_engines.generate(recorded["prompts"][-1]),
                                  "train": raw_engines.train(recorded["train"][-1])})
                line += (f"; raw generate {raw_steps[-1]['generate']['generate_s']:.3f}, "
                         f"raw train {raw_steps[-1]['train']['train_s']:.3f}")
            print(line, flush=True)
        probe = _probe_summary(probes) if probes else {}
    finally:
        if raw_engines is not None:
            raw_engines.close()
        pipeline.shutdown()
        ray.shutdown()
    raw_vllm = raw_train = None
    if raw_engines is not None:
        raw_vllm = {"generate_s": [s["generate"]["generate_s"] for s in raw_steps],
                    "tokens": [s["generate"]["tokens"] for s in raw_steps],
                    "startup_s": raw_engines.vllm_ready["startup_s"],
                    "threads_at_start": raw_engines.vllm_ready["threads_at_start"],
                    "threads_during_generate": raw_steps[-1]["generate"]["threads"],
                    "engine_args": raw_engines.engine_args, "sampling": raw_engines.sampling}
        raw_train = {key: [s["train"][key] for s in raw_steps] for key in ("old_log_probs_s", "update_s", "train_s")}
        raw_train.update(optimizer_steps=raw_steps[-1]["train"]["optimizer_steps"],
                         threads=raw_engines.train_ready[0]["threads"])
    return {"metrics": metrics, "wall": wall, "recorded": recorded, "threads": threads, "startup_s": startup,
            "probe": probe, "raw_vllm": raw_vllm, "raw_train": raw_train}


def _probe_step(pipeline, cfg, prompts, train_tensors) -> Dict[str, Optional[float]]:
    """The step's rollout and training work again, timed inside the actors (`__ray_call__`):
    the engines' own time without the driver <-> actor transfers of `dispatch`. Run right after
    the measured step so both see the same machine load; its extra optimizer steps come after
    the step's timings were taken."""
    import ray

    from roll_gspo.distributed.batch import Batch

    generate = ray.get(pipeline.actor_infer.workers[0].__ray_call__.remote(
        _probe_generate, Batch(meta={"prompt_ids": prompts}), cfg.actor_infer.generating_args))
    with_old = cfg.old_logprob_source == "trainer"
    shards = Batch(dict(train_tensors)).chunk(pipeline.actor_train.world_size)
    results = ray.get([w.__ray_call__.remote(_probe_train, shard, with_old)
                       for w, shard in zip(pipeline.actor_train.workers, shards)])
    return {"generate": generate, "old_log_probs": max(r[0] for r in results) if with_old else None,
            "train": max(r[1] for r in results)}


def _probe_summary(probes: Sequence[Dict[str, Optional[float]]]) -> Dict[str, Any]:
    keys = ("generate", "old_log_probs", "train")
    per_step = {k: [p[k] for p in probes if p.get(k) is not None] for k in keys}
    return {**{k: median(v) for k, v in per_step.items()}, "per_step": per_step}


def build_report(args, cfg, pipe: Dict[str, Any], raw_vllm: Optional[Dict[str, Any]],
                 raw_train: Optional[Dict[str, Any]], load_average: Optional[Dict[str, Any]] = None
                 ) -> Dict[str, Any]:
    warm = args.warmup
    measured = pipe["metrics"][warm:]
    wall = pipe["wall"][warm:]
    medians = phase_medians(measured, wall)
    train_batches = pipe["recorded"]["train"][warm:]
    lengths = [float(t["response_mask"].sum(-1).mean()) for t in train_batches]
    responses = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    raw: Dict[str, Any] = {}
    if raw_vllm:
        gen = raw_vllm["generate_s"][warm:]
        toks = raw_vllm["tokens"][warm:]
        raw.update(generate=median(gen), generated_tokens_mean=statistics.mean(toks) / responses if toks else None,
                   vllm_startup_s=raw_vllm["startup_s"], vllm_threads=raw_vllm["threads_during_generate"],
                   vllm_engine_args=raw_vllm["engine_args"], vllm_sampling=raw_vllm["sampling"])
        raw.setdefault("per_step", {})["generate"] = gen
    if raw_train:
        total, old, upd = (raw_train[k][warm:] for k in ("train_s", "old_log_probs_s", "update_s"))
        raw.update(train=median(total), update=median(upd),
                   old_log_probs=median(old) if cfg.old_logprob_source == "trainer" else None,
                   train_threads=raw_train["threads"], train_optimizer_steps=raw_train["optimizer_steps"])
        raw.setdefault("per_step", {}).update(train=total, old_log_probs=old, update=upd)
    step = medians.get("step_wall")
    ratios = compute_ratios(step, raw.get("generate"), raw.get("train"), medians.get("sync"), step)
    probe = pipe.get("probe") or {}
    if probe:
        # Informational, no target: the same step against the engines' time inside the actors,
        # measured right after each step (same machine load, unlike the raw runs).
        in_actor = sum(probe[k] for k in ("generate", "old_log_probs", "train") if probe.get(k) is not None)
        ratios["step_over_in_actor"] = {"value": ratio(step, in_actor), "target": None, "verdict": "info"}
    raw_tokens = raw.get("generated_tokens_mean")
    description = (f"{cfg.actor_train.model_args.model_name_or_path} | {cfg.rollout_batch_size} prompts x "
                   f"G={cfg.num_return_sequences_in_group} = {responses} responses | mean response "
                   f"{statistics.mean(lengths) if lengths else float('nan'):.2f} tokens"
                   + (f" (raw vLLM {raw_tokens:.2f})" if raw_tokens is not None else "") + " | ZeRO-"
                   f"{cfg.actor_train.strategy_args.strategy_config.get('zero_optimization', {}).get('stage', 0)}"
                   f" x {cfg.actor_train.world_size} ranks | old_logprob_source={cfg.old_logprob_source}")
    return {
        "setup": {"description": description, "config": args.config, "model": args.model,
                  "overrides": pipe.get("overrides"), "warmup_steps": warm, "measured_steps": args.steps,
                  "responses_per_step": responses, "response_length_mean": lengths,
                  "pipeline_startup_s": pipe["startup_s"], "actor_threads": pipe["threads"],
                  "cpu_count": os.cpu_count(), "load_average_1_5_15min": load_average or {}},
        "pipeline": {"median_s": medians, "per_step": per_step_lists(measured, wall),
                     "warmup_step_wall_s": pipe["wall"][:warm]},
        "probe": pipe.get("probe") or {},
        "raw": raw,
        "ratios": ratios,
        "targets": {"step_over_raw": TARGET_STEP_OVER_RAW, "sync_over_step": TARGET_SYNC_OVER_STEP},
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(REPO_ROOT, "examples", "example_gspo.yaml"))
    parser.add_argument("--model", default="builtin:tiny-arith-base", help="`pretrain` for the run")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps, not measured")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--json", dest="json_path", help="write the report here as JSON")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for the YAML (repeatable)")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="skip re-timing each measured step's work inside the pipeline's actors")
    parser.add_argument("--vllm-threads", help="OMP_NUM_THREADS for raw vLLM (default: as in the pipeline's actor)")
    parser.add_argument("--train-threads", help="OMP_NUM_THREADS for raw DeepSpeed ranks (default: as in the "
                                                "pipeline's actors)")
    parser.add_argument("--skip-raw", action="store_true", help="pipeline (and probe) only")
    parser.add_argument("--verbose", action="store_true", help="show the actors' logs")
    parser.add_argument("--_worker", choices=["vllm", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_reply_fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args._worker:
        (raw_vllm_worker if args._worker == "vllm" else raw_train_worker)(read_json(args._spec), args._reply_fd)
        return 0

    from roll_gspo.config import load_config

    workdir = tempfile.mkdtemp(prefix="bench_pipeline_")
    overrides = build_overrides(args.model, os.path.join(workdir, "output"), args.warmup + args.steps, args.override)
    cfg = load_config(args.config, overrides)
    print(f"[bench] {args.warmup} warm-up + {args.steps} measured steps, pipeline and raw engines interleaved "
          f"(work dir {workdir})", flush=True)
    # Other work on the machine skews every figure: the load average is kept with the report.
    loads = {"start": os.getloadavg()}
    run = run_interleaved(args, cfg, overrides, workdir)
    run["overrides"] = overrides
    loads["end"] = os.getloadavg()
    report = build_report(args, cfg, run, run["raw_vllm"], run["raw_train"], loads)
    print_report(format_table(report), report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
