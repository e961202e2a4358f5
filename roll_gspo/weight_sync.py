"""Weight sync, in one function: trained weights -> every rollout rank, in bounded buckets."""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Tuple

import numpy as np
import ray
import torch


def broadcast_weights(strategy, receivers: List[Any], bucket_mb: float) -> Dict[str, float]:
    """Send `strategy`'s full weights to every rollout worker in `receivers`.

    Runs on every training rank at once: under ZeRO-3 each bucket is gathered collectively
    (`strategy.iter_weight_buckets`), so at most one bucket of full weights is materialised at a
    time; rank 0 puts the bucket in Ray's object store once and every rollout rank loads it
    (`load_weight_bucket`) before the next bucket is gathered; the last bucket also tells them
    to drop caches computed with the old weights. Returns timing metrics.
    """
    start = time.perf_counter()
    sent_bytes, buckets = 0, 0
    pending = None  # each bucket is sent once the next one is known, so the last can say so
    for bucket in strategy.iter_weight_buckets(int(bucket_mb * (1 << 20))):
        if strategy.rank != 0:
            continue
        if pending is not None:
            _send(pending, receivers, last=False)
        pending = [(name, *to_wire(tensor)) for name, tensor in bucket]
        sent_bytes += sum(array.nbytes for _, array, _ in pending)
        buckets += 1
    if strategy.rank == 0 and pending is not None:
        _send(pending, receivers, last=True)
    return {"sync/seconds": time.perf_counter() - start, "sync/megabytes": sent_bytes / (1 << 20),
            "sync/buckets": float(buckets)}


def to_wire(tensor: torch.Tensor) -> Tuple[np.ndarray, str]:
    """numpy travels through Ray's object store without a pickling copy; numpy has no bfloat16,
    so those go as their int16 bit patterns."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy(), "bfloat16"
    return tensor.numpy(), ""


def from_wire(array: np.ndarray, tag: str) -> torch.Tensor:
    with warnings.catch_warnings():  # object-store arrays are read-only; loaders copy them anyway
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if tag == "bfloat16" else tensor


def _send(bucket, receivers: List[Any], last: bool) -> None:
    ref = ray.put(bucket)
    ray.get([r.load_weight_bucket.remote(ref, last=last) for r in receivers])
