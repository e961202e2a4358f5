"""Agentic turns in waves against continuous batching (issue 38 item 6): the built-in FrozenLake env
with an env latency added to every step (50 ms by default, a remote env or a tool run), played by
the real episode loop (`EpisodeRunner`) against real rollout ranks (`ActorInferWorker` Ray actors,
vLLM on CPU, the built-in micro model):

- waves: today's baseline, the ready episodes' turns in one `generate_turns` call per wave
  (`wave_generator`, a 50 ms window for slow env steps);
- continuous: what the agentic pipeline runs, one request per episode turn sent to the rank's
  engine loop as soon as its env step returns (`turn_submitter`).

Both modes run with the ranks' engine loops started, so "engine busy" is the same measure for both:
the seconds inside the engine's steps over the mode's wall time (per rank, averaged). Modes
alternate `--repeats` times on the same episodes (the same seeds: the same trajectories, checked);
medians are reported. Then the endpoint's overhead per request (benchmarks/bench_endpoint.py's
measure): an OpenAI chat request through the rollout endpoint against the same seeded request sent
straight to the rank. Times are wall time on a shared machine: compare the modes within one run.

    python benchmarks/bench_agentic_batching.py [--episodes 32] [--turns 4] [--env-latency 0.05] [--jitter 0]
        [--ranks 1] [--repeats 3] [--requests 20] [--json out.json] [--quick]

`--quick`: 4 episodes of 2 turns, one repeat, 3 overhead requests (the test's structure check).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODES = ("waves", "continuous")


class SlowEnv:
    """An env whose every step first waits `latency_s` (a remote env, a tool run), times
    1 + jitter * u, u uniform in [-1, 1] from the env's seed (the same waits in both modes)."""

    def __init__(self, env: Any, latency_s: float, jitter: float = 0.0, seed: int = 0):
        import random

        self.env, self.latency_s, self.jitter, self.random = env, latency_s, jitter, random.Random(seed)

    def reset(self, seed=None):
        return self.env.reset(seed=seed)

    def step(self, action):
        time.sleep(self.latency_s * (1 + self.jitter * self.random.uniform(-1, 1)))
        return self.env.step(action)


def agentic_config(folder: str, model: str, episodes: int, turns: int, tokens: int, ranks: int):
    """A FrozenLake agentic run's config (what the ranks and the env setups are built from)."""
    from omegaconf import OmegaConf

    from roll_gspo.config import load_config

    group = 4 if episodes % 4 == 0 else 1
    raw = {
        "pipeline": "agentic", "exp_name": "bench_agentic_batching", "seed": 7, "track_with": "none",
        "max_steps": 1, "pretrain": model, "sequence_length": 256, "rollout_batch_size": episodes,
        "output_dir": os.path.join(folder, "out"),
        "actor_infer": {"generating_args": {"temperature": 1.0}, "world_size": ranks, "num_cpus_per_worker": 0.1,
                        "strategy_args": {"strategy_name": "vllm"}},
        "custom_envs": {"Lake": {"env_type": "frozen_lake", "max_steps": turns, "max_tokens_per_step": tokens,
                                 "env_step_timeout_s": 60, "agent_system_template": "",
                                 "agent_template": "{observation}\n",  # short: the micro model holds 256 tokens
                                 "env_config": {"size": 4, "p": 0.8, "is_slippery": False, "env_instruction": ""}}},
        "train_env_manager": {"tags": ["Lake"], "num_env_groups": episodes // group, "group_size": group},
    }
    path = os.path.join(folder, "agentic.yaml")
    OmegaConf.save(OmegaConf.create(raw), path)
    return load_config(path)


def play(mode: str, runner, specs, infer, gen, turn_seed, step: int) -> Dict[str, Any]:
    """One mode's episodes: trajectories, wall seconds, engine busy fraction, turns and tokens."""
    import ray

    from pipelines.agentic_pipeline import turn_submitter, wave_generator

    before = ray.get([w.engine_loop_stats.remote() for w in infer.workers])
    start = time.perf_counter()
    if mode == "waves":
        trajectories = runner.run(specs, wave_generator(infer, gen), turn_seed)
    else:
        trajectories = runner.run(specs, None, turn_seed, submit=turn_submitter(infer, gen, f"bench-{step}"))
    wall = time.perf_counter() - start
    after = ray.get([w.engine_loop_stats.remote() for w in infer.workers])
    busy = sum(a["busy_s"] - b["busy_s"] for a, b in zip(after, before)) / len(infer.workers)
    turns = sum(len([m for m in t.messages if m["role"] == "assistant"]) for t in trajectories)
    return {"trajectories": trajectories, "wall_s": wall, "busy_fraction": busy / wall, "turns": turns,
            "turns_per_s": turns / wall, "tokens": sum(sum(t.agent_mask) for t in trajectories),
            "engine_steps": sum(a["steps"] - b["steps"] for a, b in zip(after, before))}


def compare(a: List, b: List) -> Dict[str, Any]:
    """Whether two plays of the same episodes gave the same trajectories: ids, masks, messages and
    rewards equal; the largest log-prob gap (batch composition changes float sums, not samples)."""
    fields = ("prompt_ids", "response_ids", "agent_mask", "messages", "step_rewards", "stop_reason")
    same = all(getattr(x, f) == getattr(y, f) for x, y in zip(a, b) for f in fields) and len(a) == len(b)
    gap = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x.log_probs, y.log_probs)), default=0.0)
    return {"same_trajectories": same, "max_log_prob_gap": gap}


def endpoint_overhead(cfg, infer, tokenizer, requests: int) -> Dict[str, float]:
    """bench_endpoint's per-request measure over rank 0: the endpoint against `serve_generate`."""
    import openai
    import ray

    from benchmarks.bench_endpoint import request_overhead
    from pipelines.endpoint import endpoint_sampling
    from roll_gspo.serving.backends import RayRankBackend
    from roll_gspo.serving.server import RolloutServer

    sampling = endpoint_sampling(cfg)
    server = RolloutServer([RayRankBackend(infer.workers[0])], tokenizer, model_name="tiny", template="chatml",
                           sampling=sampling, sequence_length=cfg.sequence_length)
    address = server.start()
    try:
        client = openai.OpenAI(base_url=address, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "You are on a frozen lake. Your move?"}]
        prompt_ids = tokenizer(server.render(messages, None), add_special_tokens=False)["input_ids"]
        rank = infer.workers[0]

        def direct(i: int):
            return ray.get(rank.serve_generate.remote(f"direct{i}-{time.monotonic_ns()}", prompt_ids, sampling,
                                                      1000 + i))

        request_overhead(direct, client, server, messages, 2)  # warm-up
        return request_overhead(direct, client, server, messages, requests)
    finally:
        server.stop()


def table(report: Dict[str, Any]) -> str:
    from benchmarks.harness import fmt

    rows = report["modes"]
    lines = [f"agentic FrozenLake, {report['episodes']} episodes x <= {report['turns']} turns, env latency "
             f"{report['env_latency_s'] * 1000:.0f} ms +- {report['jitter']:.0%}, {report['ranks']} rank(s), median of {report['repeats']}",
             f"{'':24}{'waves':>12}{'continuous':>12}"]
    for key, label, spec in (("turns_per_s", "turns / s", ".2f"), ("busy_fraction", "engine busy", ".0%"),
                             ("wall_s", "wall s", ".2f"), ("engine_steps", "engine steps", ".0f"),
                             ("turns", "turns", ".0f"), ("tokens", "agent tokens", ".0f")):
        lines.append(f"{label:24}{fmt(rows['waves'][key], spec):>12}{fmt(rows['continuous'][key], spec):>12}")
    lines.append(f"{'speed-up (turns / s)':24}{'':>12}{fmt(report['speedup'], '.2f') + 'x':>12}")
    lines.append(f"same trajectories: {report['same_trajectories']} (max log-prob gap "
                 f"{report['max_log_prob_gap']:.1e})")
    o = report["endpoint"]
    lines.append(f"endpoint overhead: {o['overhead_ms']:.1f} ms per request (endpoint {o['endpoint_ms']:.1f} ms, "
                 f"serve_generate {o['direct_ms']:.1f} ms, median of {o['requests']}, {o['tokens']:.1f} tokens)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4, help="FrozenLake max_steps (turns per episode)")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens_per_step")
    parser.add_argument("--env-latency", type=float, default=0.05, help="seconds added to every env step")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="env latency varies by +- this fraction (0: every step waits --env-latency)")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20, help="endpoint overhead: sequential requests")
    parser.add_argument("--model", default=None, help="model folder (default: the built-in micro model)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.turns, args.tokens, args.repeats, args.requests = 4, 2, 8, 1, 3

    import ray
    from transformers import AutoTokenizer

    from benchmarks.harness import init_local_ray, print_report
    from pipelines.agentic_pipeline import build_env_setups
    from roll_gspo.agentic.episodes import episode_specs, turn_seed_fn
    from roll_gspo.agentic.rollout import EnvSetup, EpisodeRunner
    from roll_gspo.agentic.tokens import ChatStitcher
    from roll_gspo.builtin.models import build_base_model
    from roll_gspo.config.plan.agentic import manager_generating_args
    from roll_gspo.distributed.cluster import Cluster
    from roll_gspo.workers.actor_infer import ActorInferWorker

    model = args.model or build_base_model(os.path.join(tempfile.gettempdir(), "roll_gspo_bench_endpoint_model"),
                                           seed=0, size="micro")
    folder = tempfile.mkdtemp(prefix="bench_agentic_batching_")
    cfg = agentic_config(folder, model, args.episodes, args.turns, args.tokens, args.ranks)
    if not ray.is_initialized():
        init_local_ray(args.ranks * 0.1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    setups = {tag: EnvSetup(tag, s.config, lambda seed, make=s.make: SlowEnv(make(seed), args.env_latency,
                                                                             args.jitter, seed),
                            s.error_penalty) for tag, s in build_env_setups(cfg).items()}
    gen = manager_generating_args(cfg, cfg.train_env_manager)
    runner = EpisodeRunner(ChatStitcher(tokenizer, cfg.actor_train.data_args.template), setups,
                           sequence_length=cfg.sequence_length, max_new_tokens=gen.max_new_tokens or args.tokens,
                           threads=cfg.train_env_manager.max_env_num_per_worker)
    infer = Cluster("actor_infer", ActorInferWorker, args.ranks, 0.1, 0, init_args=(cfg,))
    try:
        ray.get(infer.setup_async())
        infer.execute_all("start_engine_loop")
        specs = episode_specs(cfg.train_env_manager, args.episodes, cfg.seed, 0, "train")
        seeds = turn_seed_fn(cfg.seed, 0, len(specs), "train")
        warm = specs[:2]
        for mode in MODES:  # warm-up: vLLM's first requests, Ray's first calls
            play(mode, runner, warm, infer, gen, seeds, -1)
        runs: Dict[str, List[Dict[str, Any]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
                runs[mode].append(play(mode, runner, specs, infer, gen, seeds, repeat))
        check = compare(runs["waves"][0]["trajectories"], runs["continuous"][0]["trajectories"])
        keys = ("wall_s", "busy_fraction", "turns", "turns_per_s", "tokens", "engine_steps")
        modes = {mode: {k: statistics.median(r[k] for r in runs[mode]) for k in keys} for mode in MODES}
        overhead = endpoint_overhead(cfg, infer, tokenizer, args.requests)
    finally:
        infer.shutdown()
    report = {"episodes": args.episodes, "turns": args.turns, "tokens_per_turn": args.tokens,
              "env_latency_s": args.env_latency, "jitter": args.jitter, "ranks": args.ranks, "repeats": args.repeats, "quick": args.quick,
              "modes": modes, "runs": {m: [{k: r[k] for k in keys} for r in runs[m]] for m in MODES},
              "speedup": modes["continuous"]["turns_per_s"] / modes["waves"]["turns_per_s"],
              **check, "endpoint": overhead, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
              "command": " ".join(["python benchmarks/bench_agentic_batching.py", *(argv or sys.argv[1:])])}
    print_report(table(report), report, args.json)
    return report


if __name__ == "__main__":
    main()
