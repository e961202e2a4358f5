"""Setting up a run before its first step: the prompts and the reward block that scores each data
domain (RLVR), and the Ray clusters of its roles (actor_train, actor_infer, reference, critic, one per
reward block), placed on the GPUs their `device_mapping` reserves."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional

from roll_gspo.config import RunPlan
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.distributed.cluster import Cluster, init_ray, worker_env
from roll_gspo.distributed.fault_tolerance import PhaseDeadline, RestartBudget, replaceable_rollout
from roll_gspo.distributed.replaceable import ReplaceableCluster
from roll_gspo.placement.device_mapping import GpuPlacement, plan_for_roles, resource_totals, reward_roles
from roll_gspo.utils.imports import import_object

logger = logging.getLogger("roll_gspo")


# -- data -------------------------------------------------------------------------------------------
def load_prompts(cfg: PipelineConfig, tokenizer, data):
    """The prompt rows of one data block (`actor_train.data_args` or `validation.data_args`) and
    their load statistics."""
    from roll_gspo.data.prompts import load_prompts as load

    files = list(data.file_name)
    if cfg.tasks:  # the tasks' rows of this split (training: instead of files, refused beside them)
        from roll_gspo.config.plan.tasks import task_specs
        from roll_gspo.tasks import write_task_data

        files.append(write_task_data(task_specs(cfg), "train" if data is cfg.actor_train.data_args else "val"))
    return load(
        files, prompt_key=data.prompt_key, messages_key=data.messages_key, answer_key=data.answer_key,
        domain_key=data.domain_key, default_domain=next(iter(cfg.rewards)), tokenizer=tokenizer,
        max_prompt_length=cfg.prompt_length, max_samples=data.max_samples, template=data.template,
        tag_key=data.tag_key, dataset_dir=data.dataset_dir, num_proc=data.preprocessing_num_workers,
        require_columns=("difficulty",) if cfg.difficulty_loss_weight and data is cfg.actor_train.data_args else ())


def reward_routes(cfg: PipelineConfig) -> Dict[str, str]:
    """data domain or tag -> reward block that scores it (the block's key and its `tag_included`;
    a task's key -> its `reward` block)."""
    routes = {}
    for name, reward in cfg.rewards.items():
        for domain in [name, *reward.tag_included]:  # a block's own name routes to it, too (ROLL's `domain`)
            routes[domain] = name
    routes.update({key: task.reward for key, task in cfg.tasks.items()})
    return routes


def check_domains(items: List[dict], routes: Dict[str, str]) -> None:
    """Fail before any worker starts when a data row's domain has no reward block to score it."""
    unknown = sorted({item["domain"] for item in items} - set(routes))
    if unknown:
        raise ValueError(f"data rows have domains {unknown} that no `rewards` block scores; reward "
                         f"domains: {sorted(routes)} (add a block or `tag_included`)")


# -- workers ----------------------------------------------------------------------------------------
def log_colocation(cfg: PipelineConfig, plan: RunPlan) -> bool:
    """Log in one line what sharing GPUs does in this run (or that on CPU it is skipped); returns
    whether the rollout engine is put to sleep between phases (the plan's decision)."""
    from roll_gspo.placement.colocation import cpu_skip_message, describe

    line = cpu_skip_message(cfg, plan.offload_between_phases) or describe(cfg, plan.offload_between_phases)
    if line:
        logger.info(line)
    return plan.offload_between_phases


@dataclasses.dataclass
class RunClusters:
    """The started roles of a run, and the GPU reservation they are placed in (None without any
    `device_mapping`)."""
    placement: Optional[GpuPlacement]
    actor_train: Cluster
    actor_infer: Cluster
    reference: Optional[Cluster]  # only when a KL term needs the reference's log-probs
    rewards: Dict[str, Cluster]  # reward block name -> its CPU (or GPU) scoring workers
    critic: Optional[Cluster] = None  # PPO (adv_estimator: gae): the value model's ranks
    teachers: Dict[str, Cluster] = dataclasses.field(default_factory=dict)  # use_opd: role name -> frozen teacher
    endpoint: Optional[object] = None  # rollout_endpoint: the RolloutServer in front of actor_infer (pipelines.endpoint)


def start_clusters(cfg: PipelineConfig, run_plan: RunPlan) -> RunClusters:
    """Start Ray, reserve the mapped GPUs, and create and set up every role's cluster (the rollout
    engine first when it shares GPUs); the training and rollout ranks get the run plan."""
    from roll_gspo.workers.actor_infer import ActorInferWorker
    from roll_gspo.workers.actor_train import ActorTrainWorker
    from roll_gspo.workers.reference import ReferenceWorker

    roles = {"actor_train": cfg.actor_train, "actor_infer": cfg.actor_infer,
             **({"reference": cfg.reference} if cfg.needs_reference() else {}),
             **({"critic": cfg.critic} if cfg.uses_critic() else {}),
             **(cfg.teacher_roles() if cfg.uses_teacher() else {})}
    placeable = {**roles, **reward_roles(cfg)}
    cpus, gpus = resource_totals(placeable)
    init_ray(cpus, gpus)
    plan = plan_for_roles(placeable, cfg.num_gpus_per_node)  # those with a device_mapping
    placement = GpuPlacement(plan).reserve() if plan else None  # fails naming the shortfall
    batch = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    total_optimizer_steps = cfg.max_steps * cfg.ppo_epochs * (batch // cfg.mini_batch_size())

    def cluster(name, worker_cls, role, replaceable=None, **kwargs):
        options = placement.rank_options(name) if role.device_mapping is not None else None
        kind, extra = (ReplaceableCluster, replaceable) if replaceable else (Cluster, {})
        return kind(name, worker_cls, role.world_size, role.num_cpus_per_worker, role.num_gpus_per_worker,
                    init_args=(cfg,), init_kwargs=kwargs, env=worker_env(cfg, role), rank_options=options, **extra)

    actor_train = cluster("actor_train", ActorTrainWorker, cfg.actor_train,
                          total_optimizer_steps=total_optimizer_steps, plan=run_plan)
    if replaceable_rollout(cfg):  # a rank that dies or hangs is replaced (roll_gspo.distributed.replaceable)
        fault = cfg.fault_tolerance
        actor_infer = cluster("actor_infer", ActorInferWorker, cfg.actor_infer, plan=run_plan,
                              replaceable=dict(budget=RestartBudget(fault.max_restarts),
                                               hang_timeout_s=fault.hang_timeout_s))
    else:
        actor_infer = cluster("actor_infer", ActorInferWorker, cfg.actor_infer, plan=run_plan)
    reference = cluster("reference", ReferenceWorker, cfg.reference) if cfg.needs_reference() else None
    teachers: Dict[str, Cluster] = {}
    if cfg.uses_teacher():  # on-policy distillation: the reference's worker on each teacher block
        from roll_gspo.workers.teacher import TeacherWorker

        teachers = {name: cluster(name, TeacherWorker, role, role_name=name)
                    for name, role in cfg.teacher_roles().items()}
    critic = None
    if cfg.uses_critic():
        from roll_gspo.workers.critic import CriticWorker

        critic_steps = cfg.max_steps * cfg.ppo_epochs * (batch // cfg.critic_mini_batch_size())
        critic = cluster("critic", CriticWorker, cfg.critic, total_optimizer_steps=critic_steps)
    # A reward worker that dies is restarted and its unfinished calls scored again (fault_tolerance).
    rewards = {
        name: Cluster(f"reward_{name}", import_object(reward.worker_cls), reward.world_size,
                      reward.num_cpus_per_worker, reward.num_gpus_per_worker, init_args=(reward,),
                      init_kwargs={"domain": name, "response_length": cfg.response_length},
                      env=worker_env(cfg), max_restarts=cfg.fault_tolerance.max_restarts,
                      rank_options=placement.rank_options(f"rewards.{name}") if reward.device_mapping is not None
                      else None)
        for name, reward in cfg.rewards.items()}
    clusters = [actor_train, actor_infer, *([reference] if reference else []), *teachers.values(),
                *([critic] if critic else []),
                *rewards.values()]
    start = time.perf_counter()
    from roll_gspo.placement.colocation import start_rollout_first

    first = [actor_infer] if start_rollout_first(cfg) else []  # shared GPUs: vLLM sizes its cache first
    for group in (first, [c for c in clusters if c not in first]):
        calls = [(c, c.setup_async()) for c in group]  # the roles of a group load in parallel
        for c, refs in calls:
            c.gather(refs)  # a rank that dies meanwhile: one line naming it (a rollout rank: replaced)
    logger.info("workers ready in %.1f s", time.perf_counter() - start)
    fault = cfg.fault_tolerance  # a rank that stops answering is reported hung at a bound from the run's timing
    for waited in (actor_train, actor_infer, reference, *teachers.values(), critic):
        if waited is not None and not isinstance(waited, ReplaceableCluster):  # replaceable: its own probes
            waited.bound_waits(PhaseDeadline(fault.phase_timeout_factor, fault.phase_timeout_floor_s,
                                             max(fault.phase_timeout_floor_s, fault.hang_timeout_s)))
    return RunClusters(placement, actor_train, actor_infer, reference, rewards, critic, teachers=teachers)
