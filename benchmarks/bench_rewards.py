"""Reward throughput on this machine: code-sandbox programs per second per worker (bubblewrap and
the rlimits fallback), and what the killable reward process adds per response.

    .venv/bin/python benchmarks/bench_rewards.py [--programs 40] [--responses 2000]

Prints one line per figure. No Ray: the sandbox and the reward process are what a reward worker
runs, timed directly.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sandbox_rate(kind: str, programs: int) -> float:
    from roll_gspo.rewards.code_sandbox import Sandbox, run_tests

    sandbox = Sandbox(kind, timeout_s=5.0)
    truth = json.dumps(["assert add(1, 2) == 3"])
    run_tests(sandbox, "def add(a, b):\n    return a + b", truth)  # warm the page cache
    start = time.perf_counter()
    for _ in range(programs):
        run_tests(sandbox, "def add(a, b):\n    return a + b", truth)
    return programs / (time.perf_counter() - start)


def process_overhead_us(responses: int) -> tuple:
    """Per-response time of math_verify_reward in-process and through a RewardProcess."""
    from roll_gspo.rewards import RewardProcess, math_verify_reward

    def calls(offset):  # distinct pairs: the reward's cache must not answer them
        return [("", f"the answer is {offset + i}", str(offset + i + i % 2)) for i in range(responses)]

    for args in calls(10 ** 6)[:50]:
        math_verify_reward(*args)
    start = time.perf_counter()
    for args in calls(0):
        math_verify_reward(*args)
    direct = (time.perf_counter() - start) / responses * 1e6
    process = RewardProcess(math_verify_reward, timeout_s=10)
    process.score_many(calls(2 * 10 ** 6)[:50])  # fork + warm
    start = time.perf_counter()
    process.score_many(calls(3 * 10 ** 6))
    killable = (time.perf_counter() - start) / responses * 1e6
    process.close()
    trivial = RewardProcess(_exact, timeout_s=10)  # the round trip alone, on a reward that costs nothing
    trivial.score_many(calls(0)[:50])
    start = time.perf_counter()
    trivial.score_many(calls(0))
    round_trip = (time.perf_counter() - start) / responses * 1e6
    trivial.close()
    return direct, killable, round_trip


def _exact(prompt, response, truth):
    return float(response == truth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--responses", type=int, default=2000)
    args = parser.parse_args()
    kinds = (["bwrap"] if shutil.which("bwrap") else []) + ["rlimits"]
    for kind in kinds:
        print(f"code sandbox ({kind}): {sandbox_rate(kind, args.programs):.1f} programs/s per worker "
              f"(one test program each, sequential)")
    direct, killable, round_trip = process_overhead_us(args.responses)
    print(f"math reward in the worker: {direct:.0f} us/response; in the killable reward process: {killable:.0f} "
          f"us/response (difference {killable - direct:+.0f} us)")
    print(f"killable reward process round trip (a reward that costs nothing): {round_trip:.0f} us/response")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
