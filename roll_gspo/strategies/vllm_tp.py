"""Tensor-parallel vLLM rollout inside a Ray actor: the engine layout and its config checks.

Engine layout. With `actor_infer.strategy_args.strategy_config.tensor_parallel_size` > 1, the
rollout actor keeps vLLM's engine core in its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as
for TP = 1) and vLLM's multiprocess executor (`distributed_executor_backend: mp`) starts one worker
process per TP rank next to it. vLLM would otherwise pick its Ray executor inside a Ray actor,
which its CPU platform refuses. On CPU each worker's OpenMP threads are bound to its own cores
(`VLLM_CPU_OMP_THREADS_BIND`, derived from the actor's CPU affinity as "0|1"-style groups unless
set); vLLM's "auto" binding needs one NUMA node per rank. The actor must reserve a core per TP
rank (`num_cpus_per_worker` >= TP on CPU, `num_gpus_per_worker` >= TP on GPUs; config checks).

How weight buckets reach every TP worker: `roll_gspo.sync.vllm_workers`.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Sequence

from roll_gspo.placement.device_mapping import tensor_parallel_size


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
