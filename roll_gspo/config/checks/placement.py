"""The placement rules, as config steps: device_mapping parsed into ranks, colocation (sleep,
offload, vLLM's memory share), weight-sync routes. The rules themselves live in
`roll_gspo.placement` (below config: it returns (key, message) pairs, made Findings here)."""
from __future__ import annotations

from typing import AbstractSet, Iterable, List, Optional, Tuple

from roll_gspo.config.findings import Finding, error
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig


def _errors(pairs: Iterable[Tuple[str, str]]) -> List[Finding]:
    return [error(key, message) for key, message in pairs]


@check("normalise", keys=("<role>.device_mapping", "<role>.world_size", "<role>.num_gpus_per_worker",
                          "num_gpus_per_node"),
       doc="parses each `device_mapping` into GPU indices and derives the role's `world_size`; refuses a mapping "
           "that does not split into ranks, or a `world_size` / `num_gpus_per_worker` contradicting it",
       name="placement.device_mapping")
def _device_mappings(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]]) -> List[Finding]:
    from roll_gspo.placement.device_mapping import device_mapping_problems

    return _errors(device_mapping_problems(cfg))


@check("check", keys=("actor_infer.strategy_args.strategy_config.sleep_level", "is_offload_states",
                      "offload_train_params", "actor_infer.strategy_args.strategy_config.gpu_memory_utilization",
                      "rewards.<domain>.device_mapping"),
       doc="sleep and offload keys that cannot act (sleep_level outside 1/2 or off vLLM, sleep mode on CPU, "
           "offloading with ZeRO stage 0 outside fp32), a vLLM memory share that overfills a shared GPU, and "
           "a reward sharing the rollout engine's GPUs (or another reward's, or without offloading)",
       name="placement.colocation", requires=("placement.device_mapping", "roll_compat.grad_norm"))
def _colocation(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]]) -> List[Finding]:
    from roll_gspo.placement.colocation import colocation_problems

    return _errors(colocation_problems(cfg))


@check("check", keys=("weight_sync_transport",),
       doc="`weight_sync_transport: collective` where the planned placement has a rollout worker the "
           "collective cannot reach", name="placement.weight_routes",
       requires=("placement.device_mapping", "roll_compat.grad_norm"))
def _weight_routes(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]]) -> List[Finding]:
    from roll_gspo.placement.cluster_plan import weight_route_problems

    return [error("weight_sync_transport", p) for p in weight_route_problems(cfg)]


@check("settle", keys=("actor_infer.strategy_args.strategy_config.gpu_memory_utilization",
                       "rewards.<domain>.strategy_args.strategy_config.sleep_level"),
       doc="a vLLM rollout rank sharing its GPU reserves its share of it (not vLLM's 0.9), and a reward "
           "sharing GPUs sleeps between reward phases (sleep_level 1), unless the YAML sets them",
       name="placement.shares")
def _fill_shares(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]]) -> List[Finding]:
    from roll_gspo.placement.colocation import fill_gpu_memory_utilization, fill_reward_sleep_level

    fill_reward_sleep_level(cfg)
    if cfg.has_rollout():
        fill_gpu_memory_utilization(cfg)
    return []
