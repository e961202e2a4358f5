"""Which malloc `memory_allocator: auto` gives a model role's workers (roll_gspo.distributed.allocator
sets it; roll_gspo.placement.host_memory plans for it): one rule, read by both."""
from __future__ import annotations

from typing import Optional

# `memory_allocator: auto` keeps the system malloc from this policy size on. Measured at 0.5B
# (docs/benchmarks.md, "Host memory at 0.5B"): with jemalloc without decay a training rank grew by
# ~1 GiB per micro-batch and never stopped (6.6 -> 19.5 GiB over 12 micro-batches of 1 x 192 tokens,
# then Ray killed it). At SmolLM2-135M (bf16, ZeRO-2, two training ranks) it did the same: both
# ranks at 10.2 GiB when Ray killed them in step 7, against 3.6-3.9 GiB flat with the system malloc
# (2026-11-27). jemalloc's speed gain was measured at 19M: the line is drawn between 19M and 135M.
AUTO_JEMALLOC_MAX_PARAMETERS = 100_000_000


def auto_uses_jemalloc(on_gpu: bool, parameters: Optional[int]) -> bool:
    """What `auto` picks: jemalloc for CPU roles of a policy below AUTO_JEMALLOC_MAX_PARAMETERS
    (or of unknown size); the system malloc on GPUs (the gain was not measured there) and for
    larger policies on CPU."""
    return not on_gpu and (parameters is None or parameters < AUTO_JEMALLOC_MAX_PARAMETERS)
