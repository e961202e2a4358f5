"""The engines a role runs, by `strategy_args.strategy_name`, each with the facts the config checks,
placement and the workers ask of it.

The classes live in `roll_gspo.strategies` (torch, vLLM, DeepSpeed); this table is what the layers
below them read instead of comparing strategy names: which roles may run an engine, whether it
serves rollout requests or trains, whether it sleeps between phases, whether one rank spans several
GPUs, how it reports log-probs, whether it takes LoRA adapters, and whether its `strategy_config`
is vLLM's. The workers build the class an entry names (`roll_gspo.strategies.engine_class`).
Adding an engine is an entry here plus its class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

PACKAGE = "roll_gspo.strategies"

# The config roles an engine may run. `judge`: the model an LLM-judge reward worker loads itself.
ROLES = ("actor_train", "critic", "reference", "actor_infer", "judge")


@dataclass(frozen=True)
class EngineKind:
    """One `strategy_name`: its class (`cls` in `module` under `PACKAGE`), the `roles` it may run, and:

    `train_engine`: a `TrainEngineStrategy`; built frozen it scores for the reference, and ZeRO-3
    or FSDP2 can shard it (otherwise the reference loads the plain model).
    `reads_attn_implementation`: transformers loads its model, so `model_args.attn_implementation`
    (flash_attention_2 needs a CUDA GPU) applies.
    `sleep_levels`: the `strategy_config.sleep_level` values it takes to free its GPU memory between
    phases (empty: it has no sleep mode, and keeps its memory).
    `parallel_keys`: the `strategy_config` keys whose product is the GPUs one rank spans (empty:
    one GPU per rank).
    `logprobs_modes`: the modes its sampler reports sampled tokens' log-probs in (vLLM's
    `logprobs_mode`, chosen by the sampling keys); empty: it re-scores the responses as the trainer
    does, so its log-probs are the trainer's quantity for any sampling keys.
    `loads_lora_adapters`: it serves LoRA adapters without merging them (`lora_sync: adapter`).
    `vllm_engine_args`: its `strategy_config` holds `vllm.EngineArgs` keywords, so vLLM's checks
    apply (the keys it knows, dtype spellings, `max_model_len`, `gpu_memory_utilization`, its CPU
    attention's block sizes and head dims, how it admits long prompts).
    """
    name: str
    module: str
    cls: str
    roles: Tuple[str, ...]
    title: str  # a few words naming it in messages
    train_engine: bool = False
    reads_attn_implementation: bool = True
    sleep_levels: Tuple[int, ...] = ()
    parallel_keys: Tuple[str, ...] = ()
    logprobs_modes: Tuple[str, ...] = ()
    loads_lora_adapters: bool = False
    vllm_engine_args: bool = False

    def __post_init__(self) -> None:
        if set(self.roles) - set(ROLES):
            raise ValueError(f"{self.name}: roles must be a subset of {ROLES}")

    @property
    def serves_requests(self) -> bool:
        """It samples behind the request-level `RolloutEngine` contract (it may run actor_infer)."""
        return "actor_infer" in self.roles

    @property
    def trains(self) -> bool:
        """It has an optimizer (it may run actor_train)."""
        return "actor_train" in self.roles

    @property
    def kind(self) -> str:
        """`rollout` (samples), `train` (trains, and scores frozen) or `frozen` (scores only)."""
        return "rollout" if self.serves_requests else "train" if self.trains else "frozen"

    @property
    def spans_gpus(self) -> bool:
        """One rank may span several GPUs (tensor or pipeline parallel)."""
        return bool(self.parallel_keys)

    @property
    def path(self) -> str:
        """The module that holds the class."""
        return f"{PACKAGE}.{self.module}"


TRAIN_ROLES = ("actor_train", "critic", "reference")
VLLM_PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size")

# In the order the schema lists them (the loader's "valid values" and the config reference).
ENGINES: Dict[str, EngineKind] = {e.name: e for e in (
    EngineKind("deepspeed_train", "deepspeed_strategy", "DeepSpeedStrategy", TRAIN_ROLES,
               "DeepSpeed ZeRO", train_engine=True),
    EngineKind("fsdp2_train", "fsdp2_strategy", "FSDP2Strategy", TRAIN_ROLES,
               "torch FSDP2", train_engine=True),
    EngineKind("vllm", "vllm_strategy", "VllmStrategy", ("actor_infer", "judge"),
               "vLLM", reads_attn_implementation=False, sleep_levels=(1, 2),
               parallel_keys=VLLM_PARALLEL_KEYS, logprobs_modes=("processed_logprobs", "raw_logprobs"),
               loads_lora_adapters=True, vllm_engine_args=True),
    EngineKind("hf_infer", "hf_infer_strategy", "HfInferStrategy", ("actor_infer", "judge", "reference"),
               "transformers' generate"),
    EngineKind("deepspeed_infer", "deepspeed_strategy", "DeepSpeedStrategy", ("reference",),
               "frozen DeepSpeed ZeRO", train_engine=True),
    EngineKind("fsdp2_infer", "fsdp2_strategy", "FSDP2Strategy", ("reference",),
               "frozen torch FSDP2", train_engine=True),
)}


# What an empty or unbuilt `strategy_name` is: no engine, so no fact holds (the checks refuse the
# name where a role needs an engine).
NO_ENGINE = EngineKind("", "", "", (), "no engine", reads_attn_implementation=False)


def engine_of(strategy_name: str) -> EngineKind:
    """The engine a `strategy_name` names; `NO_ENGINE` for an empty or unbuilt one."""
    return ENGINES.get(strategy_name, NO_ENGINE)


def names(role: Optional[str] = None) -> List[str]:
    """The strategy names, in the table's order; with `role`: those that may run it."""
    if role is not None and role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {ROLES}")
    return [e.name for e in ENGINES.values() if role is None or role in e.roles]


def frozen_names() -> List[str]:
    """ROLL's names of frozen engines: those that only score (the reference's `_infer` names)."""
    return [e.name for e in ENGINES.values() if e.kind == "frozen"]
