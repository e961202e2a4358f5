"""How fast do trained weights reach the rollout ranks, by each `weight_sync_transport`?

    .venv/bin/python benchmarks/bench_weight_sync.py                  # built-in size and ~100M parameters
    .venv/bin/python benchmarks/bench_weight_sync.py --sizes 100m --repeats 5 --bucket-mb 256 --json out.json
    .venv/bin/python benchmarks/bench_weight_sync.py --smoke          # seconds; what the test suite runs

For each model size it builds a Qwen2 model locally with random weights (`tiny` is the built-in
`builtin:tiny-arith-base` shape, `100m` about 100M parameters; nothing is downloaded), then times
roll_gspo's own sync path, `weight_sync.broadcast_weights` with a `WeightSender`, from this
process (playing training rank 0) to `--receivers` Ray actors on this node (playing rollout
ranks), for every transport:

* `shared_memory` (`auto` on CPU): one /dev/shm segment per sync, reused by its buckets and freed
  after the last (so each sync makes and faults one in); receivers read its tensors in place;
* `object_store`: `ray.put` of each bucket, receivers fetch it;
* `collective`: the weight-sync group (gloo here, NCCL on GPUs), one broadcast per bucket.

Receivers take each bucket as a rollout rank does (`receive_bucket` / `CollectiveReceiver`) and
copy every tensor into a weight buffer of their own, as an engine's weight loader would (the
object store hands out zero-copy views of its shared memory, so without that copy it would be
measured doing less work than the others). The engine's own load (vLLM's loaders, re-packing) is
not measured: it is the same for all transports. The first sync of each transport (group set-up, first imports) is a warm-up and
not counted. GB/s is the model's bytes over the median sync time (per receiver, not summed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Qwen2 shapes; head_dim stays one vLLM's CPU attention supports.
SIZES = {
    "micro": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=384, vocab_size=64),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=64),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
}
TRANSPORTS = {"shared_memory": "auto", "object_store": "object_store", "collective": "collective"}


def random_weights(size: str) -> List[Tuple[str, torch.Tensor]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SIZES[size], tie_word_embeddings=False, torch_dtype="float32"))
    return [(name, param.detach()) for name, param in model.named_parameters()]


class StateDictBuckets:
    """`iter_weight_buckets` over fixed tensors, bucketed as DeepSpeedStrategy does."""

    def __init__(self, weights: List[Tuple[str, torch.Tensor]]):
        self.weights = weights

    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        group, size = [], 0
        for index, (name, tensor) in enumerate(self.weights):
            group.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes or index == len(self.weights) - 1:
                yield group
                group, size = [], 0


class TransportSink:
    """A rollout rank's receiving end without an engine."""

    def __init__(self):
        from roll_gspo.sync.broadcast import SharedSegmentReader
        from roll_gspo.sync.collective import CollectiveReceiver

        self.shared, self.collective, self.received_bytes = SharedSegmentReader(), CollectiveReceiver(), 0
        self.weights = {}  # name -> this receiver's copy

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def weight_receivers(self) -> int:
        return 1

    def join_weight_group(self, *args) -> None:
        self.collective.join(*args)

    def load_weight_bucket(self, bucket, first: bool, last: bool) -> None:
        from roll_gspo.sync.broadcast import receive_bucket
        from roll_gspo.sync.collective import CollectiveBucket

        tensors = (self.collective.receive(bucket) if isinstance(bucket, CollectiveBucket)
                   else receive_bucket(bucket, self.shared, copy=False))  # copied below, as vLLM's direct loads do
        for name, tensor in tensors:
            if name not in self.weights:
                self.weights[name] = torch.empty_like(tensor)
            self.weights[name].copy_(tensor)
            self.received_bytes += tensor.numel() * tensor.element_size()
        del tensors
        if last:
            self.shared.close()  # as a rollout rank does after a sync


def start_sinks(receivers: int) -> list:
    """`receivers` fresh receiving actors (their worker processes start in the background)."""
    import ray

    return [ray.remote(num_cpus=0.01)(TransportSink).remote() for _ in range(receivers)]


def measure(weights, transport: str, receivers: int, bucket_mb: float, repeats: int, sinks=None) -> Dict[str, float]:
    """One transport's syncs to `sinks` (fresh actors of its own; started here when not given)."""
    import ray

    from roll_gspo.sync.broadcast import WeightSender, broadcast_weights

    sinks = start_sinks(receivers) if sinks is None else sinks
    ray.get([s.node_id.remote() for s in sinks])
    bucket_bytes = int(bucket_mb * (1 << 20))
    strategy = StateDictBuckets(weights)
    try:
        start = time.perf_counter()
        sender = WeightSender(sinks, TRANSPORTS[transport], bucket_bytes, timeout_s=600)
        broadcast_weights(strategy, bucket_bytes, sender)  # warm-up: group / segment set-up
        first = time.perf_counter() - start
        seconds = [broadcast_weights(strategy, bucket_bytes, sender)["sync/seconds"] for _ in range(repeats)]
        received = ray.get([s.__ray_call__.remote(lambda sink: sink.received_bytes) for s in sinks])
    finally:
        for sink in sinks:
            ray.kill(sink)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    if any(r != nbytes * (repeats + 1) for r in received):
        raise RuntimeError(f"{transport}: receivers got {received} bytes, expected {nbytes * (repeats + 1)} each")
    median = statistics.median(seconds)
    return {"first_sync_s": first, "sync_s_median": median, "sync_s_min": min(seconds),
            "gb_per_s": nbytes / median / 1e9}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "100m"], choices=sorted(SIZES))
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    parser.add_argument("--receivers", type=int, default=1, help="rollout ranks (Ray actors) to reach")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="weight_sync_bucket_mb")
    parser.add_argument("--repeats", type=int, default=3, help="measured syncs per transport (after 1 warm-up)")
    parser.add_argument("--smoke", action="store_true",
                        help="micro model, 1 repeat, small buckets, every transport's receivers started at once")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the sending process (Ray gives a training rank of < 2 CPUs one; "
                             "on a busy machine a 2-thread copy waits for both threads to be scheduled)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.sizes, args.repeats, args.bucket_mb = ["micro"], 1, 0.05

    import ray

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ray.init(num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    results = []
    try:
        for size in args.sizes:
            weights = random_weights(size)
            params = sum(t.numel() for _, t in weights)
            megabytes = sum(t.numel() * t.element_size() for _, t in weights) / (1 << 20)
            # --smoke: every transport's own receivers are started at once, before the first is
            # measured (their worker processes' start-ups overlap instead of coming one by one).
            early = {t: start_sinks(args.receivers) for t in args.transports} if args.smoke else {}
            for transport in args.transports:
                row = {"size": size, "parameters": params, "megabytes": megabytes, "transport": transport,
                       "receivers": args.receivers, "bucket_mb": args.bucket_mb,
                       **measure(weights, transport, args.receivers, args.bucket_mb, args.repeats,
                                 early.get(transport))}
                results.append(row)
                print(f"{size:>6} {params / 1e6:8.1f}M params {megabytes:8.1f} MB  {transport:<14} "
                      f"sync {row['sync_s_median'] * 1e3:9.1f} ms (min {row['sync_s_min'] * 1e3:.1f}, first "
                      f"{row['first_sync_s'] * 1e3:.0f})  {row['gb_per_s']:7.3f} GB/s", flush=True)
    finally:
        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
