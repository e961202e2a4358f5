"""Weight sync, in one function: trained weights -> every rollout rank, in bounded buckets."""
from __future__ import annotations

import time
from typing import Any, Dict, List

import ray


def broadcast_weights(strategy, receivers: List[Any], bucket_mb: float) -> Dict[str, float]:
    """Send `strategy`'s full weights to every rollout worker in `receivers`.

    Runs on every training rank at once: under ZeRO-3 each bucket is gathered collectively
    (`strategy.iter_weight_buckets`), so at most one bucket of full weights is materialised at a
    time; rank 0 puts the bucket in Ray's object store once and every rollout rank loads it
    (`load_weight_bucket`) before the next bucket is gathered. Returns timing metrics.
    """
    start = time.perf_counter()
    sent_bytes, buckets = 0, 0
    for bucket in strategy.iter_weight_buckets(int(bucket_mb * (1 << 20))):
        if strategy.rank != 0:
            continue
        ref = ray.put(bucket)
        ray.get([r.load_weight_bucket.remote(ref) for r in receivers])
        sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        buckets += 1
    if strategy.rank == 0:
        ray.get([r.finish_weight_update.remote() for r in receivers])
    return {"sync/seconds": time.perf_counter() - start, "sync/megabytes": sent_bytes / (1 << 20),
            "sync/buckets": float(buckets)}
