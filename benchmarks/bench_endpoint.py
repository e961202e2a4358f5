"""The rollout endpoint's cost (issue 38): per-request overhead of the OpenAI endpoint over a
request sent straight to the engine loop, and concurrent episodes' turns per second with the
engine's busy fraction. vLLM (CPU) on the built-in micro model, one rank, in-process.

    python benchmarks/bench_endpoint.py [--requests 40] [--episodes 16] [--turns 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    import openai
    from transformers import AutoTokenizer

    from roll_gspo.builtin.models import build_base_model
    from roll_gspo.schema.config import RoleConfig
    from roll_gspo.serving.backends import LoopBackend
    from roll_gspo.serving.server import RolloutServer
    from roll_gspo.strategies.engine import Sampling
    from roll_gspo.strategies.engine_loop import EngineLoop
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    folder = build_base_model(os.path.join(tempfile.gettempdir(), "roll_gspo_bench_endpoint_model"), seed=0,
                              size="micro")
    role = RoleConfig()
    role.model_args.model_name_or_path = str(folder)
    loop = EngineLoop(VllmStrategy(role, max_model_len=256, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    server = RolloutServer([LoopBackend(loop)], tokenizer, model_name="tiny", template="chatml",
                           sampling=Sampling(max_new_tokens=args.max_tokens, temperature=1.0), sequence_length=256)
    address = server.start()
    print(f"endpoint at {address}")
    client = openai.OpenAI(base_url=address, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "what is 2+3?"}]
    prompt_ids = tokenizer(server.render(messages, None), add_special_tokens=False)["input_ids"]
    sampling = Sampling(max_new_tokens=args.max_tokens, temperature=1.0)
    for i in range(5):  # warm-up
        loop.submit(f"warm{i}", prompt_ids, sampling, seed=i).result()
        client.chat.completions.create(model="tiny", messages=messages, seed=i, user="warm")
    server.take_episode("warm")

    o = request_overhead(lambda i: loop.submit(f"d{i}", prompt_ids, sampling, seed=1000 + i).result(), client,
                         server, messages, args.requests)
    print(f"sequential, {args.requests} requests of {o['tokens']:.1f} tokens: engine loop {o['direct_ms']:.1f} ms, "
          f"endpoint {o['endpoint_ms']:.1f} ms (median); overhead {o['overhead_ms']:.1f} ms per request")

    async def episode(ac, i):
        history = [{"role": "user", "content": f"task {i}"}]
        for _ in range(args.turns):
            r = await ac.chat.completions.create(model="tiny", messages=history, user=f"c{i}")
            history += [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": "next"}]

    async def concurrent():
        ac = openai.AsyncOpenAI(base_url=address, api_key="x", max_retries=0)
        await asyncio.gather(*(episode(ac, i) for i in range(args.episodes)))

    busy0, steps0 = loop.busy_s, loop.steps
    start = time.perf_counter()
    asyncio.run(concurrent())
    wall = time.perf_counter() - start
    turns = args.episodes * args.turns
    reused = sum(server.take_episode(f"c{i}").reused_turns for i in range(args.episodes))
    print(f"{args.episodes} episodes x {args.turns} turns at once: {turns / wall:.1f} turns/s, engine busy "
          f"{(loop.busy_s - busy0) / wall:.0%} of {wall:.2f} s, {loop.steps - steps0} engine steps for {turns} turns, "
          f"{reused} turns reused recorded ids")
    server.stop()
    loop.close()


def request_overhead(direct, client, server, messages, requests: int, model: str = "tiny") -> dict:
    """The endpoint's cost per request: `requests` seeded requests, each sent straight to the engine
    (`direct(i)`: the request seeded 1000 + i, its `RequestOutput`) and then as an OpenAI chat
    request (`client`, the same seed; its episode taken from `server`), one at a time. Medians in
    ms; the two must sample the same ids."""
    direct_s, served_s, tokens = [], [], []
    for i in range(requests):
        start = time.perf_counter()
        out = direct(i)
        direct_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        resp = client.chat.completions.create(model=model, messages=messages, seed=1000 + i, user=f"overhead{i}")
        served_s.append(time.perf_counter() - start)
        assert resp.choices[0].token_ids == out.token_ids  # the same seeded request both ways
        tokens.append(len(out.token_ids))
        server.take_episode(f"overhead{i}")
    d, s = statistics.median(direct_s) * 1000, statistics.median(served_s) * 1000
    return {"requests": requests, "tokens": statistics.mean(tokens), "direct_ms": d, "endpoint_ms": s,
            "overhead_ms": s - d}


if __name__ == "__main__":
    main()
