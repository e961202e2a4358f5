"""The rollout ranks behind the endpoint: one backend per rank, each a token-id request in and the
engine's `RequestOutput` (ids, log-probs, weight versions) out, awaited on the server's event loop.

`LoopBackend`: an `EngineLoop` in this process (tests, a single-process setup).
`RayRankBackend`: an `ActorInferWorker` rank (`serve_generate` / `serve_abort`, which submit to the
rank's engine loop from Ray's `serve` concurrency group).
`Router`: least requests in flight for a new episode, then sticky: an episode's turns go to the rank
that holds its prefix in cache (the rank is pinned on the episode's record, so it goes with it).
"""
from __future__ import annotations

import asyncio
from typing import List, Optional, Sequence

from roll_gspo.strategies.engine import RequestOutput, Sampling


class LoopBackend:
    def __init__(self, loop):
        self.loop = loop
        self.in_flight = 0

    async def generate(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling,
                       seed: Optional[int]) -> RequestOutput:
        return await asyncio.wrap_future(self.loop.submit(request_id, list(prompt_ids), sampling, seed))

    async def abort(self, request_id: str) -> None:
        self.loop.abort([request_id])


class RayRankBackend:
    def __init__(self, handle):
        self.handle = handle
        self.in_flight = 0

    async def generate(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling,
                       seed: Optional[int]) -> RequestOutput:
        return await self.handle.serve_generate.remote(request_id, list(prompt_ids), sampling, seed)

    async def abort(self, request_id: str) -> None:
        await self.handle.serve_abort.remote([request_id])


class Router:
    """Picks a rank per request: the episode's pinned one, else the least busy. It keeps no state
    per episode: the pin lives on the episode's record and is freed with it."""

    def __init__(self, backends: List):
        if not backends:
            raise ValueError("the endpoint needs at least one rollout rank")
        self.backends = backends

    def pick(self, pinned: Optional[int]) -> int:
        """`pinned`: the rank of the episode's earlier requests (its prefix in cache), or None."""
        if pinned is not None:
            return pinned
        return min(range(len(self.backends)), key=lambda r: self.backends[r].in_flight)
