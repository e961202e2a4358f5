"""What a run decided, recorded once: `build_run_plan(cfg)` after `validate_config`, a frozen
`RunPlan` the pipeline, the workers and `--dry-run` read instead of deriving the same facts again.

The config says what the user wrote (and what validation filled in); the plan says what follows
from it for this run: which roles start and where (each role's parsed device map, world size,
GPUs and CPUs per rank), whether the roles free their memory between phases and how deep vLLM
sleeps, where the old log-probs come from and why, what scores the reference log-probs (a
reference role, the trainer with its LoRA adapter disabled, or nothing), whether a critic runs,
and the weight-sync route of every rollout worker where placement decides it before any worker
starts (on GPUs; on CPU Ray picks a rank's node at run time, and the route says so).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from roll_gspo.config.plan.async_mode import generates_ahead, staleness_bound
from roll_gspo.config.plan.drift_alarm import drift_thresholds
from roll_gspo.config.plan.model_shape import policy_shape
from roll_gspo.config.plan.policy_loss import describe_policy_loss
from roll_gspo.config.plan.rollout_logprobs import OldLogprobChoice, choose_old_logprob_source
from roll_gspo.placement.cluster_plan import ClusterSpec, gpu_roles, plan_cluster
from roll_gspo.placement.colocation import colocation, offload_between_phases, offload_reason, sleep_level
from roll_gspo.placement.device_mapping import reward_roles
from roll_gspo.metrics.drift import DriftThresholds
from roll_gspo.placement.memory import ModelShape
from roll_gspo.schema.config import PipelineConfig, RoleConfig
from roll_gspo.schema.frozen import freeze, is_frozen

REFERENCE_ROLE = "role"  # a frozen reference model of its own (the `reference` role)
REFERENCE_ADAPTER_OFF = "adapter_disabled"  # LoRA: actor_train scores them with its adapter disabled
REFERENCE_NONE = "none"  # no KL term needs reference log-probs


@dataclass(frozen=True)
class RolePlan:
    """One role the run starts: its ranks and what each reserves."""
    name: str  # "actor_train", "actor_infer", "reference", "critic", "rewards.<domain>"
    strategy: str
    world_size: int
    gpus_per_worker: float
    cpus_per_worker: float
    device_mapping: Optional[Tuple[int, ...]] = None  # global GPU indices; None: Ray places the ranks

    @property
    def on_gpu(self) -> bool:
        return self.device_mapping is not None or self.gpus_per_worker > 0

    def describe(self) -> str:
        where = (f"GPUs {list(self.device_mapping)}" if self.device_mapping is not None else
                 f"{self.gpus_per_worker:g} GPU" if self.gpus_per_worker else "CPU only")
        return (f"{self.name}: {self.world_size} x {self.strategy} ({where}, {self.gpus_per_worker:g} GPU / "
                f"{self.cpus_per_worker:g} CPU per rank)")


@dataclass(frozen=True)
class RunPlan:
    """The run's decisions (see the module docstring). Frozen: built once, read everywhere."""
    pipeline: str  # rlvr | agentic | sft
    roles: Tuple[RolePlan, ...]
    offload_between_phases: bool  # the roles sharing the rollout engine's GPUs free them between phases
    offload_reason: str  # why (is_offload_states, or whether actor_infer shares its GPUs)
    colocated_with: Tuple[str, ...]  # roles that may share a rollout GPU
    sleep_level: Optional[int]  # vLLM's sleep level between phases; None: it does not sleep
    old_logprobs: Optional[OldLogprobChoice]  # where the old log-probs come from and why; None: sft
    reference: str  # REFERENCE_ROLE, REFERENCE_ADAPTER_OFF or REFERENCE_NONE
    critic: bool  # a critic role runs (PPO, adv_estimator gae)
    weight_sync_transport: Optional[str]  # None: no rollout engine (sft)
    weight_routes: Tuple[str, ...]  # one line per rollout rank (or worker): how the weights reach it
    policy_parameters: Optional[int]  # the policy's size when its shape is known before it is built
    policy_loss: Optional[str] = None  # which policy loss runs, in words (plan/policy_loss); None: sft
    # async_generation_ratio, decided here once: the rollouts generated ahead of the step that trains
    # them (0: synchronous; 1: one step ahead, for ratio 1 and k >= 2), and k >= 2's staleness bound
    # (the pooled sources' partial rollouts; None for 0 and 1).
    rollout_depth: int = 0
    staleness_bound: Optional[int] = None
    drift: Optional[DriftThresholds] = None  # the drift alarm's warn and stop gaps; None: no alarm

    def role(self, name: str) -> RolePlan:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"the run starts no role {name!r} (it starts {', '.join(r.name for r in self.roles)})")

    def lines(self) -> List[str]:
        """The plan as `--dry-run` prints it: a short "run plan" section."""
        out = [f"run plan: {self.pipeline} pipeline"]
        out += [f"  {role.describe()}" for role in self.roles]
        if self.weight_sync_transport is not None:
            if self.offload_between_phases:
                rollout = (f"vLLM sleeps at level {self.sleep_level}" if self.sleep_level is not None else
                           "the rollout engine keeps its memory")
                out.append(f"  offload between phases: on ({self.offload_reason}): {rollout}; actor_train's states "
                           f"go to CPU outside training")
            else:
                out.append(f"  offload between phases: off ({self.offload_reason})")
        if self.policy_loss is not None:
            out.append(f"  policy loss: {self.policy_loss}")
        if self.weight_sync_transport is not None:
            out.append(f"  rollout: {self.rollout_mode()}")
        if self.old_logprobs is not None:
            out.append(f"  old log-probs: {self.old_logprobs.source} ({self.old_logprobs.reason})")
        out.append(f"  reference log-probs: {_REFERENCE_TEXT[self.reference]}")
        if self.drift is not None:
            out.append(f"  drift alarm: warn above a log-prob gap of {self.drift.warn:g}, stop above "
                       f"{self.drift.stop:g} ({self.drift.basis})")
        out.append(f"  critic: {'yes (adv_estimator gae)' if self.critic else 'none'}")
        return out

    def rollout_mode(self) -> str:
        """How generation overlaps training, in words."""
        if self.staleness_bound is not None:
            return (f"one step ahead, work in flight across steps (request or episode pools), a staleness bound "
                    f"of {self.staleness_bound} versions")
        return "one step ahead of training" if self.rollout_depth else "synchronous"

    def text(self) -> str:
        return "\n".join(self.lines())


_REFERENCE_TEXT = {
    REFERENCE_ROLE: "the reference role (a frozen copy of the policy)",
    REFERENCE_ADAPTER_OFF: "actor_train with its LoRA adapter disabled (no reference role starts)",
    REFERENCE_NONE: "none (no KL term needs them)",
}


def reference_mode(cfg: PipelineConfig) -> str:
    """What scores the reference log-probs."""
    if not cfg.has_rollout() or not cfg.needs_reference_log_probs():
        return REFERENCE_NONE
    return REFERENCE_ROLE if cfg.needs_reference() else REFERENCE_ADAPTER_OFF


def _role_plan(name: str, role: RoleConfig) -> RolePlan:
    mapping = role.device_mapping
    return RolePlan(name, role.strategy_args.strategy_name, role.world_size, float(role.num_gpus_per_worker or 0),
                    float(role.num_cpus_per_worker), tuple(int(g) for g in mapping) if mapping is not None else None)


def _reward_plan(name: str, reward) -> RolePlan:  # a RewardConfig: the same placement keys as a role
    mapping = reward.device_mapping
    worker = str(reward.worker_cls).rpartition(".")[2]
    return RolePlan(name, worker, reward.world_size, float(reward.num_gpus_per_worker or 0),
                    float(reward.num_cpus_per_worker), tuple(int(g) for g in mapping) if mapping is not None else None)


def build_run_plan(cfg: PipelineConfig, model_is_moe: Optional[bool] = None,
                   shape: Optional[ModelShape] = None) -> RunPlan:
    """The run's decisions from a validated config. `model_is_moe`: whether the policy routes
    tokens to experts (None: from its shape, read from its config.json or a built-in's registered
    config; the pipeline may pass what the built folder says). `shape`: the policy's shape when the
    caller has read it already."""
    if shape is None:
        try:
            shape = policy_shape(cfg)
        except Exception:  # noqa: BLE001  (an unreadable config.json: preflight names it; the size is unknown)
            shape = None
    if model_is_moe is None:
        model_is_moe = bool(shape and shape.num_experts > 0)
    roles = [_role_plan(name, role) for name, role in gpu_roles(cfg).items()]
    roles += [_reward_plan(name, reward) for name, reward in reward_roles(cfg).items()]
    rollout = cfg.has_rollout()
    offload = offload_between_phases(cfg)
    sleeps = rollout and bool(cfg.actor_infer.strategy_args.engine.sleep_levels)
    routes: Tuple[str, ...] = ()
    if rollout:
        # The routes on nodes of num_gpus_per_node GPUs, as the run places the ranks; `--dry-run`
        # prints them against the cluster it describes.
        routes = tuple(line.strip() for line in plan_cluster(cfg, ClusterSpec(max(cfg.num_gpus_per_node, 1)),
                                                             shape).routes[1:])
    return RunPlan(
        pipeline=cfg.pipeline,
        roles=tuple(roles),
        offload_between_phases=offload,
        offload_reason=f"is_offload_states {offload_reason(cfg)}" if rollout else "no rollout engine",
        colocated_with=tuple(colocation(cfg).shared_with) if rollout else (),
        sleep_level=sleep_level(cfg) if offload and sleeps else None,
        old_logprobs=choose_old_logprob_source(cfg, model_is_moe=model_is_moe) if rollout else None,
        reference=reference_mode(cfg),
        critic=cfg.uses_critic(),
        weight_sync_transport=cfg.weight_sync_transport if rollout else None,
        weight_routes=routes,
        policy_parameters=shape.num_parameters() if shape is not None else None,
        policy_loss=describe_policy_loss(cfg) if rollout else None,
        rollout_depth=int(rollout and generates_ahead(cfg)),
        staleness_bound=staleness_bound(cfg) if rollout else None,
        drift=drift_thresholds(cfg),
    )


def freeze_config(cfg: PipelineConfig) -> PipelineConfig:
    """Make a loaded, validated config read-only (in place; returns it): setting a key then raises
    `ReadOnlyConfigError` naming its path. What the run derives goes in its `RunPlan`."""
    return cfg if is_frozen(cfg) else freeze(cfg)
