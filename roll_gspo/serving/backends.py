"""The rollout ranks behind the endpoint: one backend per rank, each a token-id request in and the
engine's `RequestOutput` (ids, log-probs, weight versions) out, awaited on the server's event loop.

`LoopBackend`: an `EngineLoop` in this process (tests, a single-process setup).
`RayRankBackend`: an `ActorInferWorker` rank (`serve_generate` / `serve_abort`, which submit to the
rank's engine loop from Ray's `serve` concurrency group).
`Router`: least requests in flight for a new episode, then sticky: an episode's turns go to the rank
that holds its prefix in cache.
"""
from __future__ import annotations

import asyncio
from typing import Dict, List, Optional, Sequence

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
    """Picks a rank per episode: the least busy for its first request, then the same one."""

    def __init__(self, backends: List):
        if not backends:
            raise ValueError("the endpoint needs at least one rollout rank")
        self.backends = backends
        self.sticky: Dict[str, int] = {}

    def pick(self, episode_id: str) -> int:
        rank = self.sticky.get(episode_id)
        if rank is None:
            rank = min(range(len(self.backends)), key=lambda r: self.backends[r].in_flight)
            self.sticky[episode_id] = rank
        return rank

    def forget(self, episode_id: str) -> None:
        self.sticky.pop(episode_id, None)
