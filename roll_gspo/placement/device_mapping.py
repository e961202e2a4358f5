"""Placement by `device_mapping` (ROLL's key): which GPUs each role's ranks use.

A role's `device_mapping` lists global GPU indices; GPU `g` is GPU `g % num_gpus_per_node` of node
`g // num_gpus_per_node`. Consecutive groups of `num_gpus_per_worker` indices form one rank, so a
role has `len(device_mapping) / num_gpus_per_worker` ranks. Roles whose maps overlap share those
GPUs (colocated, e.g. actor_train and actor_infer on the same 8); disjoint maps split the machine.

On Ray this becomes one placement group per node index (all its bundles on one node), one bundle
per GPU used there: `{"GPU": 1, "CPU": <the CPUs of the ranks anchored on it>}`. A rank is anchored
on the bundle of its first GPU and asks for an equal share of that GPU, so colocated roles fit the
same bundle; a rank with several GPUs is shown the others through CUDA_VISIBLE_DEVICES. The plan is
checked against the cluster's nodes before any placement group or worker exists: each node index
gets a Ray node of its own, and its placement group is pinned there (the `ray.io/node-id` label),
so roles mapped to different node indices run on different nodes.

The parser reads the string forms ROLL users write (`list(range(0,16))`, `range(0,8)`, `[0,1,2]`,
`"0,1"`) with `ast`, never `eval`.
"""
from __future__ import annotations

import ast
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from roll_gspo.catalog.reward_workers import loads_model, model_workers
from roll_gspo.schema.config import PipelineConfig

logger = logging.getLogger("roll_gspo.placement")
PLACEMENT_TIMEOUT_S = float(os.environ.get("ROLL_GSPO_PLACEMENT_TIMEOUT_S", "300"))
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node (ray.util.placement_group.NODE_ID_LABEL_KEY)
DEVICE_MAPPING_FORMS = "a list of GPU indices ([0, 1, 2]), 'list(range(0, 8))', 'range(0, 8)', '[0,1,2]' or '0,1'"


class PlacementError(ValueError):
    """A device_mapping that cannot be placed; the message names the key and the shortfall."""


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------
def _int_literal(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise ValueError(f"{ast.unparse(node)!r} is not a whole number")


def _range_call(node: ast.AST) -> Optional[List[int]]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" \
            and not node.keywords and 1 <= len(node.args) <= 3:
        return list(range(*[_int_literal(a) for a in node.args]))
    return None


def _parse_expression(text: str) -> List[int]:
    tree = ast.parse(text.strip(), mode="eval").body
    if isinstance(tree, (ast.List, ast.Tuple)):
        return [_int_literal(e) for e in tree.elts]
    if isinstance(tree, ast.Constant) and type(tree.value) is int:
        return [tree.value]
    ranged = _range_call(tree)
    if ranged is not None:
        return ranged
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id == "list" \
            and len(tree.args) == 1 and not tree.keywords:
        inner = _range_call(tree.args[0])
        if inner is not None:
            return inner
        if isinstance(tree.args[0], (ast.List, ast.Tuple)):
            return [_int_literal(e) for e in tree.args[0].elts]
    raise ValueError("not one of the accepted forms")


def parse_device_mapping(value: Any, key: str = "device_mapping") -> Optional[List[int]]:
    """GPU indices of a `device_mapping` value, or None when unset. Raises PlacementError naming
    `key` for anything but the accepted forms, negative or repeated indices, or an empty list."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise PlacementError(f"{key}: expected {DEVICE_MAPPING_FORMS}, got {value!r}")
    try:
        if isinstance(value, int):
            gpus = [value]
        elif isinstance(value, (list, tuple)):
            bad = [v for v in value if type(v) is not int]
            if bad:
                raise ValueError(f"{bad[0]!r} is not a whole number")
            gpus = list(value)
        elif isinstance(value, str):
            gpus = _parse_expression(value) if value.strip()[:1] in "[(lr" else \
                [_int_literal(ast.parse(p.strip(), mode="eval").body) for p in value.split(",") if p.strip()]
        else:
            raise ValueError(f"a {type(value).__name__}")
    except (ValueError, SyntaxError) as exc:
        raise PlacementError(f"{key}: cannot read {value!r} ({exc}); expected {DEVICE_MAPPING_FORMS} "
                             f"(never evaluated as Python)") from None
    if not gpus:
        raise PlacementError(f"{key}: {value!r} names no GPU; leave it null for a CPU role")
    negative = [g for g in gpus if g < 0]
    if negative:
        raise PlacementError(f"{key}: GPU indices must be >= 0, got {negative}")
    repeated = sorted({g for g in gpus if gpus.count(g) > 1})
    if repeated:
        raise PlacementError(f"{key}: GPU indices {repeated} appear more than once")
    return gpus


def ranks_of(gpus: Sequence[int], num_gpus_per_worker: int, num_gpus_per_node: int, key: str) -> List[List[int]]:
    """The GPUs of each rank: consecutive groups of `num_gpus_per_worker`, each within one node."""
    if len(gpus) % num_gpus_per_worker:
        raise PlacementError(f"{key}: {len(gpus)} GPUs do not split into ranks of num_gpus_per_worker = "
                             f"{num_gpus_per_worker}")
    ranks = [list(gpus[i:i + num_gpus_per_worker]) for i in range(0, len(gpus), num_gpus_per_worker)]
    for rank, group in enumerate(ranks):
        nodes = sorted({g // num_gpus_per_node for g in group})
        if len(nodes) > 1:
            raise PlacementError(f"{key}: rank {rank} would span nodes {nodes} (GPUs {group}, "
                                 f"num_gpus_per_node = {num_gpus_per_node}); a rank's GPUs (a vLLM rank's tensor-parallel "
                                 f"group) must be on one node: align the device_mapping so that each group of "
                                 f"{num_gpus_per_worker} stays within one node's {num_gpus_per_node}")
    return ranks


# --------------------------------------------------------------------------------------------
# Config checks: each role's mapping split into ranks, and a rank's reservation for its vLLM workers
# --------------------------------------------------------------------------------------------
GPU_ROLES = ("actor_train", "actor_infer", "reference")


def reward_roles(cfg: PipelineConfig) -> Dict[str, Any]:
    """Each reward block as a placeable role named `rewards.<domain>` (rlvr pipeline; none otherwise)."""
    if cfg.pipeline != "rlvr":
        return {}
    return {f"rewards.{domain}": reward for domain, reward in cfg.rewards.items()}


def mapped_roles(cfg: PipelineConfig) -> Dict[str, Any]:
    """Everything a device_mapping can place: the three roles, the critic (when there is one) and
    the reward blocks."""
    critic = {"critic": cfg.critic} if cfg.critic is not None else {}
    teacher = cfg.teacher_roles()
    return {**{name: getattr(cfg, name) for name in GPU_ROLES}, **critic, **teacher, **reward_roles(cfg)}


def _reward_mapping_problem(name: str, reward) -> Optional[str]:
    """A reward's device_mapping only acts for a worker that loads a model on those GPUs."""
    worker = str(reward.worker_cls).rpartition(".")[2]
    if not loads_model(worker):  # only a worker that loads a model can use the GPUs of a mapping
        return (f"{name}.device_mapping: {worker} scores by rules on CPUs and loads no model; only "
                f"{' and '.join(model_workers())} use GPUs. Drop the mapping")
    if worker == "LLMJudgeRewardWorker" and (reward.judge_model_type or "api") != "inference":
        return (f"{name}.device_mapping: the judge is an API endpoint (judge_model_type: "
                f"{reward.judge_model_type or 'api'}); a mapping places a judge model loaded by the worker "
                f"(judge_model_type: inference). Drop one of them")
    return None


def device_mapping_problems(cfg: PipelineConfig) -> List[Tuple[str, str]]:
    """Parse each role's (and reward block's) device_mapping (in place, to a list) and derive its
    world_size and whole num_gpus_per_worker; a mapping that cannot split into ranks is a problem:
    (the key it is about, the message)."""
    problems = []
    roles = mapped_roles(cfg)
    for name, role in roles.items():
        if name.startswith("rewards.") and role.device_mapping is not None:
            problem = _reward_mapping_problem(name, role)
            if problem:
                problems.append((f"{name}.device_mapping", problem))
                continue
        try:
            role.device_mapping = parse_device_mapping(role.device_mapping, f"{name}.device_mapping")
        except PlacementError as exc:
            problems.append((f"{name}.device_mapping", str(exc)))
            continue
        if role.device_mapping is None:
            continue
        per_worker = role.num_gpus_per_worker or 1
        kind = role.strategy_args.engine
        if kind.spans_gpus:  # as in ROLL: a vLLM rank spans TP x PP GPUs
            engine = role.strategy_args.strategy_config
            parallel = math.prod(int(engine.get(key, 1)) for key in kind.parallel_keys)
            if role.num_gpus_per_worker and role.num_gpus_per_worker != parallel:
                problems.append((f"{name}.num_gpus_per_worker",
                                 f"{name}.num_gpus_per_worker = {role.num_gpus_per_worker:g} contradicts the "
                                 f"{kind.title} engine's {' x '.join(kind.parallel_keys)} = {parallel} (GPUs per "
                                 f"rank); leave num_gpus_per_worker out"))
                continue
            per_worker = parallel
        if per_worker != int(per_worker) or per_worker < 1:
            problems.append((f"{name}.num_gpus_per_worker", f"{name}.num_gpus_per_worker: must be a whole number >= 1 "
                                                            f"with a device_mapping, got {role.num_gpus_per_worker}"))
            continue
        if per_worker > 1 and kind.roles and not kind.spans_gpus:
            problems.append((f"{name}.num_gpus_per_worker",
                             f"{name}.num_gpus_per_worker = {per_worker:g}: {role.strategy_args.strategy_name} ranks "
                             f"use one GPU each (one rank per GPU: set it to 1)"))
            continue
        try:
            ranks = ranks_of(role.device_mapping, int(per_worker), max(cfg.num_gpus_per_node, 1),
                             f"{name}.device_mapping")
        except PlacementError as exc:
            problems.append((f"{name}.device_mapping", str(exc)))
            continue
        if role.world_size not in (1, len(ranks)):
            problems.append((f"{name}.world_size", f"{name}.world_size = {role.world_size} contradicts device_mapping: "
                                                   f"{len(role.device_mapping)} GPUs / num_gpus_per_worker "
                                                   f"{per_worker:g} = {len(ranks)} ranks (leave world_size out)"))
        role.world_size, role.num_gpus_per_worker = len(ranks), float(per_worker)
    if cfg.num_gpus_per_node < 1:
        problems.append(("num_gpus_per_node", f"num_gpus_per_node: must be >= 1, got {cfg.num_gpus_per_node}"))
    return problems


def tensor_parallel_size(engine_args: Dict[str, Any]) -> int:
    return int(engine_args.get("tensor_parallel_size", 1) or 1)


def tensor_parallel_problems(role, role_name: str = "actor_infer") -> List[Tuple[str, str]]:
    """Config problems of a vLLM role's TP setting, (key, message): reservations too small for its workers."""
    tp_size = tensor_parallel_size(role.strategy_args.strategy_config)
    if tp_size <= 1:
        return []
    key = f"{role_name}.strategy_args.strategy_config.tensor_parallel_size = {tp_size}"
    backend = role.strategy_args.strategy_config.get("distributed_executor_backend", "mp")
    if backend != "mp":
        return [(f"{role_name}.strategy_args.strategy_config.distributed_executor_backend",
                 f"{role_name}.strategy_args.strategy_config.distributed_executor_backend = {backend!r}: tensor "
                 f"parallel rollout runs with vLLM's multiprocess executor ('mp') inside the Ray actor; drop the key")]
    if role.num_gpus_per_worker and role.num_gpus_per_worker < tp_size:
        return [(f"{role_name}.strategy_args.strategy_config.tensor_parallel_size",
                 f"{key} needs a GPU per vLLM worker: raise {role_name}.num_gpus_per_worker "
                 f"({role.num_gpus_per_worker:g}) to {tp_size}")]
    if not role.num_gpus_per_worker and role.num_cpus_per_worker < tp_size:
        return [(f"{role_name}.strategy_args.strategy_config.tensor_parallel_size",
                 f"{key} starts {tp_size} vLLM worker processes, each bound to its own core: raise "
                 f"{role_name}.num_cpus_per_worker ({role.num_cpus_per_worker:g}) to at least {tp_size} so Ray "
                 f"reserves them")]
    return []


# --------------------------------------------------------------------------------------------
# The plan (pure) and its Ray placement groups
# --------------------------------------------------------------------------------------------
@dataclass
class RankSlot:
    """Where one rank runs: node index, its GPUs (global indices) and its share of the first."""
    role: str
    rank: int
    node_index: int
    gpus: List[int]
    num_cpus: float
    gpu_share: float = 1.0


@dataclass
class PlacementPlan:
    num_gpus_per_node: int
    slots: Dict[str, List[RankSlot]] = field(default_factory=dict)

    @property
    def gpus(self) -> List[int]:
        return sorted({g for slots in self.slots.values() for s in slots for g in s.gpus})

    def node_gpus(self) -> Dict[int, List[int]]:
        """node index -> the global GPU indices used there."""
        out: Dict[int, List[int]] = {}
        for gpu in self.gpus:
            out.setdefault(gpu // self.num_gpus_per_node, []).append(gpu)
        return out

    def bundle_cpus(self, gpu: int) -> float:
        return sum(s.num_cpus for slots in self.slots.values() for s in slots if s.gpus[0] == gpu)

    def describe(self) -> str:
        parts = []
        for role, slots in self.slots.items():
            parts.append(f"{role}: " + ", ".join(f"rank {s.rank} -> node {s.node_index} GPU "
                                                   f"{'+'.join(str(g % self.num_gpus_per_node) for g in s.gpus)}"
                                                   for s in slots))
        return "; ".join(parts)


def plan_placement(roles: Dict[str, tuple], num_gpus_per_node: int) -> PlacementPlan:
    """`roles`: name -> (gpu indices, num_gpus_per_worker, num_cpus_per_worker). Ranks anchored on
    the same GPU split it equally (Ray's fixed-point resources: shares rounded down to 1e-4)."""
    if num_gpus_per_node < 1:
        raise PlacementError(f"num_gpus_per_node: must be >= 1 with a device_mapping, got {num_gpus_per_node}")
    plan = PlacementPlan(num_gpus_per_node)
    for name, (gpus, per_worker, cpus) in roles.items():
        groups = ranks_of(gpus, per_worker, num_gpus_per_node, f"{name}.device_mapping")
        plan.slots[name] = [RankSlot(name, r, g[0] // num_gpus_per_node, g, cpus) for r, g in enumerate(groups)]
    anchored: Dict[int, int] = {}
    for slots in plan.slots.values():
        for slot in slots:
            anchored[slot.gpus[0]] = anchored.get(slot.gpus[0], 0) + 1
    for slots in plan.slots.values():
        for slot in slots:
            slot.gpu_share = int(10_000 / anchored[slot.gpus[0]]) / 10_000
    return plan


def assign_node_indices(needs: Dict[int, tuple], nodes: List[Dict[str, Any]]) -> Dict[int, Optional[int]]:
    """Which node (position in `nodes`, each `{"GPU": n, "CPU": n}`) holds each node index of a
    plan (`needs`: node index -> (GPUs, CPUs)); None where no node is left for it. Every node index
    gets a node of its own, as device_mapping says (GPU g is on node g // num_gpus_per_node):
    node k when it is free and fits, else the first free node that fits, largest need first."""
    free = set(range(len(nodes)))
    out: Dict[int, Optional[int]] = {}
    for index in sorted(needs, key=lambda i: (-needs[i][0], -needs[i][1], i)):
        gpus, cpus = needs[index]

        def fits(n: int) -> bool:
            return (float(nodes[n].get("GPU", 0)) + 1e-6 >= gpus
                    and (nodes[n].get("CPU") is None or float(nodes[n]["CPU"]) + 1e-6 >= cpus))

        choice = index if index in free and fits(index) else next((n for n in sorted(free) if fits(n)), None)
        out[index] = choice
        free.discard(choice)
    return out


def check_plan_against_nodes(plan: PlacementPlan, nodes: List[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """The alive node (a ray.nodes() record) of each node index of the plan; raise PlacementError
    naming the shortfall when the cluster cannot give each node index a node of its own with its
    GPUs and CPUs."""
    alive = [n for n in nodes if n.get("Alive", True)]
    resources = [{"GPU": float(n["Resources"].get("GPU", 0)), "CPU": float(n["Resources"].get("CPU", 0))}
                 for n in alive]
    needs = {index: (len(gpus), sum(plan.bundle_cpus(g) for g in gpus)) for index, gpus in plan.node_gpus().items()}
    chosen = assign_node_indices(needs, resources)
    for node_index, position in sorted(chosen.items(), key=lambda item: (-needs[item[0]][0], item[0])):
        if position is not None:
            continue
        gpus, (count, cpus) = plan.node_gpus()[node_index], needs[node_index]
        taken = {p for p in chosen.values() if p is not None}
        have = ", ".join(f"{_node_name(n)} with {r['GPU']:g} GPUs / {r['CPU']:g} CPUs"
                         + (" (taken by another node index)" if i in taken else "")
                         for i, (n, r) in enumerate(zip(alive, resources))) or "no alive node"
        roles = sorted({s.role for slots in plan.slots.values() for s in slots if set(s.gpus) & set(gpus)})
        best = max((r["GPU"] for i, r in enumerate(resources) if i not in taken), default=0)
        total = sum(n for n, _ in needs.values())
        raise PlacementError(
            f"device_mapping cannot be placed: node index {node_index} (GPUs {gpus} of {', '.join(roles)}; "
            f"num_gpus_per_node = {plan.num_gpus_per_node}) needs one node with {count} GPUs and "
            f"{cpus:g} CPUs; the Ray cluster has {have}, short by {count - best:g} GPUs on its largest free "
            f"node. The mapping uses {total} GPUs on {len(needs)} node(s), each node index on a node of its "
            f"own: add GPUs or nodes, shrink the device_mapping, or drop it (null) to run the role with "
            f"world_size / num_cpus_per_worker (CPU)")
    return {index: alive[position] for index, position in chosen.items() if position is not None}  # all placed


def _node_name(node: Dict[str, Any]) -> str:
    return node.get("NodeManagerAddress", node.get("NodeID", "?"))


class GpuPlacement:
    """The plan's placement groups on Ray and each rank's actor options."""

    def __init__(self, plan: PlacementPlan):
        self.plan = plan
        self.groups: Dict[int, Any] = {}
        self.bundle_index: Dict[int, int] = {}  # global GPU -> bundle index in its node's group
        self.gpu_ids: Dict[int, str] = {}  # global GPU -> the device id Ray gave its bundle
        self.node_ids: Dict[int, str] = {}  # node index -> Ray node id

    def reserve(self) -> "GpuPlacement":
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        chosen = check_plan_against_nodes(self.plan, ray.nodes())
        for node_index, gpus in self.plan.node_gpus().items():
            bundles = []
            for i, gpu in enumerate(gpus):
                cpus = self.plan.bundle_cpus(gpu)
                bundles.append({"GPU": 1.0, **({"CPU": cpus} if cpus else {})})
                self.bundle_index[gpu] = i
            # Pinned to the node the check chose, so distinct node indices land on distinct nodes
            # (by resources alone two small node indices could share one large node).
            pin = [{NODE_ID_LABEL: chosen[node_index]["NodeID"]}] * len(bundles) if "NodeID" in chosen[node_index] else None
            self.groups[node_index] = placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=pin,
                                                      name=f"roll_gspo_node{node_index}_{os.getpid()}")
        try:
            ray.get([g.ready() for g in self.groups.values()], timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            for group in self.groups.values():
                remove_placement_group(group)
            self.groups = {}
            raise PlacementError(
                f"device_mapping: Ray could not reserve the GPUs of {self.plan.describe()} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (available now: {ray.available_resources()})") from None
        self._probe()
        logger.info("device_mapping placement: %s", self.plan.describe())
        return self

    def _probe(self) -> None:
        """Which device id and node each bundle got (a rank with several GPUs must be shown them)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=0, num_gpus=1e-4)
        def where() -> tuple:
            context = ray.get_runtime_context()
            return context.get_node_id(), [str(i) for i in context.get_accelerator_ids().get("GPU", [])]

        calls = {gpu: where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.groups[gpu // self.plan.num_gpus_per_node], placement_group_bundle_index=self.bundle_index[gpu])).remote()
            for gpu in self.plan.gpus}
        for gpu, ref in calls.items():
            node_id, ids = ray.get(ref)
            self.gpu_ids[gpu] = ids[0] if ids else str(gpu % self.plan.num_gpus_per_node)
            self.node_ids[gpu // self.plan.num_gpus_per_node] = node_id

    def rank_options(self, role: str) -> List[Dict[str, Any]]:
        """Ray actor options of each rank of `role`, in rank order."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = []
        for slot in self.plan.slots[role]:
            first = slot.gpus[0]
            option = {"num_cpus": slot.num_cpus, "num_gpus": slot.gpu_share,
                      "scheduling_strategy": PlacementGroupSchedulingStrategy(
                          self.groups[slot.node_index], placement_group_bundle_index=self.bundle_index[first])}
            if len(slot.gpus) > 1:  # Ray only shows the anchor's GPU; the rank sets the rest itself
                option["runtime_env"] = {"env_vars": {
                    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                    "CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids[g] for g in slot.gpus)}}
            options.append(option)
        return options

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            remove_placement_group(group)
        self.groups = {}


def plan_for_roles(roles: Dict[str, Any], num_gpus_per_node: int) -> Optional[PlacementPlan]:
    """The plan of the roles (name -> RoleConfig, validated) that have a device_mapping; None if
    none has."""
    mapped = {name: (role.device_mapping, int(role.num_gpus_per_worker or 1), role.num_cpus_per_worker)
              for name, role in roles.items() if role.device_mapping is not None}
    return plan_placement(mapped, num_gpus_per_node) if mapped else None


def resource_totals(roles: Dict[str, Any]) -> tuple:
    """(CPUs of all roles, GPUs of the roles without a device_mapping): the cluster-wide check;
    mapped roles' GPUs are checked node by node by `GpuPlacement.reserve`."""
    cpus = sum(r.world_size * r.num_cpus_per_worker for r in roles.values())
    gpus = sum(r.world_size * r.num_gpus_per_worker for r in roles.values() if r.device_mapping is None)
    return cpus, gpus
