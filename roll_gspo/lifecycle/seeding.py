"""Random streams as functions of where they are used, never of an engine's history, so that a
run resumed from a checkpoint draws exactly what an uninterrupted run draws.

Rollout: prompt p of a step's batch gets a base seed from (seed, stream, step, p); its sample i
uses base + i (vLLM's own rule for a request with n > 1; hf_infer follows it)."""
from __future__ import annotations

from typing import List

import numpy as np

STREAMS = {"train": 0, "validation": 1,
           # The agentic pipeline: env seeds of a step's groups, sampling seeds of its turns.
           "train-env": 2, "validation-env": 3, "train-turns": 4, "validation-turns": 5,
           # Which step-wise samples batch_adjust_mode copies or drops.
           "batch-adjust": 6}


def stream_id(stream: str) -> int:
    """`train`, `validation`, `train-round<k>` (dynamic sampling's k-th generation of a step), or
    the agentic pipeline's `{train,validation}-{env,turns}`."""
    if stream.startswith("train-round"):
        return 1000 + int(stream[len("train-round"):])
    return STREAMS[stream]


def rollout_seeds(seed: int, step: int, num_prompts: int, stream: str = "train") -> List[int]:
    """(num_prompts,) base seeds, below 2**31 so base + sample index stays a valid seed."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, stream_id(stream), int(step)])
    return [int(x) >> 1 for x in state.generate_state(num_prompts, dtype=np.uint32)]


def trainer_seed(seed: int, optimizer_step: int, rank: int) -> int:
    """Seed of a training rank's torch RNG (dropout) for the update starting at `optimizer_step`."""
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 2, int(optimizer_step), int(rank)])
               .generate_state(1, dtype=np.uint32)[0])
