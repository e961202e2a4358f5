"""Tensor-parallel vLLM rollout inside a Ray actor, and how weight buckets reach every vLLM worker.

Engine layout. With `actor_infer.strategy_args.strategy_config.tensor_parallel_size` > 1, the
rollout actor keeps vLLM's engine core in its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as
for TP = 1) and vLLM's multiprocess executor (`distributed_executor_backend: mp`) starts one worker
process per TP rank next to it. vLLM would otherwise pick its Ray executor inside a Ray actor,
which its CPU platform refuses. On CPU each worker's OpenMP threads are bound to its own cores
(`VLLM_CPU_OMP_THREADS_BIND`, derived from the actor's CPU affinity as "0|1"-style groups unless
set); vLLM's "auto" binding needs one NUMA node per rank. The actor must reserve a core per TP
rank (`num_cpus_per_worker` >= TP on CPU, `num_gpus_per_worker` >= TP on GPUs; config checks).

Weight path (the engine's RPC pickles tensors into nested lists, so no tensor goes through it):
each vLLM worker takes the bucket itself and loads its own shard through the model's weight
loaders (`WorkerBucketLoading`, mixed into `WeightUpdateExtension`):

* shared memory (`weight_sync_transport: auto`, rollout rank on the trainer's node): only the
  segment's name and layout (`SharedBucket`) travel through `collective_rpc`; every worker maps
  the trainer's segment and copies its tensors out;
* object store: the rollout actor copies the bucket into a shared-memory segment of its own and
  passes that on the same way;
* collective (`weight_sync_transport: collective`): every worker is a member of the weight-sync
  group (`roll_gspo.collective_sync`) and receives the broadcast itself; only the layout travels
  through `collective_rpc`.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

# Config checks import this module: what the weight path needs is imported where it is used.


def tensor_parallel_size(engine_args: Dict[str, Any]) -> int:
    return int(engine_args.get("tensor_parallel_size", 1) or 1)


def cpu_thread_binding(tp_size: int, cores: Sequence[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp_size` workers sharing `cores`: equal contiguous groups,
    e.g. 2 workers on cores [0, 1, 2, 3] -> "0,1|2,3". Cores left over go unused."""
    cores = sorted(cores)
    if len(cores) < tp_size:
        raise ValueError(f"actor_infer.strategy_args.strategy_config.tensor_parallel_size = {tp_size} needs a CPU "
                         f"core per vLLM worker; this rollout actor may run on {len(cores)} ({cores}). Lower "
                         f"tensor_parallel_size or set VLLM_CPU_OMP_THREADS_BIND yourself")
    per_worker = len(cores) // tp_size
    return "|".join(",".join(str(c) for c in cores[i * per_worker:(i + 1) * per_worker]) for i in range(tp_size))


def prepare_tensor_parallel(engine_args: Dict[str, Any]) -> None:
    """Make `engine_args` (and this process's environment) start TP > 1 inside a Ray actor:
    the multiprocess executor, and on CPU a thread binding per worker. No-op for TP = 1."""
    tp_size = tensor_parallel_size(engine_args)
    if tp_size <= 1:
        return
    backend = engine_args.setdefault("distributed_executor_backend", "mp")
    if backend != "mp":
        raise ValueError(f"actor_infer.strategy_args.strategy_config.distributed_executor_backend = {backend!r}: "
                         f"roll_gspo runs tensor parallel rollout with vLLM's multiprocess executor ('mp') inside "
                         f"its Ray actor (vLLM's Ray executor would start actors of its own); drop the key")
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp_size, os.sched_getaffinity(0))


def tensor_parallel_problems(role, role_name: str = "actor_infer") -> List[str]:
    """Config problems of a vLLM role's TP setting: reservations too small for its workers."""
    tp_size = tensor_parallel_size(role.strategy_args.strategy_config)
    if tp_size <= 1:
        return []
    key = f"{role_name}.strategy_args.strategy_config.tensor_parallel_size = {tp_size}"
    backend = role.strategy_args.strategy_config.get("distributed_executor_backend", "mp")
    if backend != "mp":
        return [f"{role_name}.strategy_args.strategy_config.distributed_executor_backend = {backend!r}: tensor "
                f"parallel rollout runs with vLLM's multiprocess executor ('mp') inside the Ray actor; drop the key"]
    if role.num_gpus_per_worker and role.num_gpus_per_worker < tp_size:
        return [f"{key} needs a GPU per vLLM worker: raise {role_name}.num_gpus_per_worker "
                f"({role.num_gpus_per_worker:g}) to {tp_size}"]
    if not role.num_gpus_per_worker and role.num_cpus_per_worker < tp_size:
        return [f"{key} starts {tp_size} vLLM worker processes, each bound to its own core: raise "
                f"{role_name}.num_cpus_per_worker ({role.num_cpus_per_worker:g}) to at least {tp_size} so Ray "
                f"reserves them"]
    return []


class WorkerBucketRelay:
    """The rollout actor's side: hands a bucket to every vLLM worker without tensors in the RPC
    (`collective_rpc` carries only a segment name or a layout)."""

    def __init__(self, llm):
        self.llm = llm
        self.segment = None  # a SharedSegmentWriter, for buckets that came by object store

    def load(self, payload, reader) -> None:
        from roll_gspo.collective_sync import CollectiveBucket
        from roll_gspo.weight_sync import SharedBucket, SharedSegmentWriter, receive_bucket

        if isinstance(payload, CollectiveBucket):
            self.llm.collective_rpc("roll_gspo_receive_collective_bucket", args=(payload,))
        elif isinstance(payload, SharedBucket):
            self.llm.collective_rpc("roll_gspo_load_shared_bucket", args=(payload,))
        else:
            if self.segment is None:
                self.segment = SharedSegmentWriter()
            shared = self.segment.write(receive_bucket(payload, reader))
            self.llm.collective_rpc("roll_gspo_load_shared_bucket", args=(shared,))
            self.segment.delivered()

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                          backend: str) -> None:
        self.llm.collective_rpc("roll_gspo_join_weight_group",
                                args=(host, port, first_rank, world_size, timeout_s, backend))


class WorkerBucketLoading:
    """Methods every vLLM worker gets (through `WeightUpdateExtension`): take a bucket itself and
    load this worker's shard of it with `roll_gspo_load_weights`."""

    def roll_gspo_load_shared_bucket(self, bucket) -> None:
        from roll_gspo.weight_sync import SharedSegmentReader

        if getattr(self, "_roll_gspo_shared_reader", None) is None:
            self._roll_gspo_shared_reader = SharedSegmentReader()
        self.roll_gspo_load_weights(self._roll_gspo_shared_reader.read(bucket))

    def roll_gspo_join_weight_group(self, host: str, port: int, first_rank: int, world_size: int,
                                    timeout_s: float, backend: str) -> None:
        from roll_gspo.collective_sync import CollectiveReceiver

        # This worker's rank in the engine (its TP rank) places it after the engine's first rank.
        self._roll_gspo_collective = CollectiveReceiver()
        self._roll_gspo_collective.join(host, port, first_rank + int(self.rank), world_size, timeout_s, backend)

    def roll_gspo_receive_collective_bucket(self, meta) -> None:
        self.roll_gspo_load_weights(self._roll_gspo_collective.receive(meta))
