"""The placement plan `--dry-run` prints: which rank of which role sits on which node and GPU, and
what each device holds, checked against a described cluster. Pure: no Ray, no torch.

Where ranks go:
- a role with a `device_mapping` goes where it says: GPU g is GPU g % num_gpus_per_node of node
  index g // num_gpus_per_node (roll_gspo.placement.device_mapping), each node index on a node of its
  own (node k when it fits, as at run time);
- a role without one but with `num_gpus_per_worker` > 0 is placed by Ray at run time; the plan
  shows what first fit on the GPUs left gives (a rank's whole GPUs on one node, fractions sharing
  a GPU), which is how Ray's PACK groups fill an empty cluster;
- ranks without a GPU (reward workers, CPU runs) are listed with their CPUs: Ray picks the node.

What each device holds (roll_gspo.placement.memory's estimates): a training rank its ZeRO shard of
weights, gradients and optimizer states plus the activations of one micro-batch; a reference rank
its weights and one scoring pass; a vLLM rank's TP worker the share of the device it claims,
`gpu_memory_utilization`, which must hold its weight shard and the KV cache of its batch. Ranks
sharing a device add up. A device fits when the estimated parts, kept 10 % below what the claims
leave, fit (vLLM's claim is exact: it takes that share whatever it needs).

Weight sync: how the trained weights will reach each rollout rank (CUDA IPC, NCCL, shared memory,
object store), decided from the planned devices by roll_gspo.placement.weight_routes, the decision
the run takes from the real ones.

Colocation hook: `Occupant.held` gives what a rank holds in each phase (rollout, train); a device's
peak is its larger phase sum. Without vLLM sleep or DeepSpeed state offload every rank holds all of
it in both phases, so colocated roles simply add up; `_phase_holdings` is where a rank that frees
memory while the other role works says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from roll_gspo.placement.memory import (GIB, MARGIN, ModelShape, frozen_memory, rollout_memory,
                                         lora_parameters, shape_of_model_folder, training_memory)
from roll_gspo.placement.weight_routes import DevicePlace, WeightRouteError, route_lines, weight_routes
from roll_gspo.schema.config import PipelineConfig, RoleConfig

PHASES = ("rollout", "train")
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's own default for gpu_memory_utilization


@dataclass
class NodeSpec:
    name: str
    gpus: int
    cpus: Optional[float] = None
    missing: bool = False  # not in the described cluster: the plan needs it


@dataclass
class ClusterSpec:
    """The cluster a plan is checked against. `nodes` None: not described (as many nodes of
    `gpus_per_node` as the plan needs, nothing checked but the memory)."""
    gpus_per_node: int
    nodes: Optional[List[NodeSpec]] = None
    device_memory_gib: Optional[float] = None
    source: str = "not described"
    from_ray: bool = False  # nodes as Ray reports them: node indices go where the run would put them

    @classmethod
    def described(cls, nodes: int, gpus_per_node: int, device_memory_gib: Optional[float] = None) -> "ClusterSpec":
        return cls(gpus_per_node, [NodeSpec(f"node {i}", gpus_per_node) for i in range(nodes)], device_memory_gib,
                   f"{nodes} node(s) x {gpus_per_node} GPUs, described on the command line")

    @classmethod
    def from_ray_nodes(cls, records: List[Dict[str, Any]], gpus_per_node: int,
                       device_memory_gib: Optional[float] = None, address: str = "") -> "ClusterSpec":
        """From `ray.nodes()` records (alive ones)."""
        nodes = [NodeSpec(f"{r.get('NodeManagerAddress', '?')} ({str(r.get('NodeID', ''))[:8]})",
                          int(r["Resources"].get("GPU", 0)), float(r["Resources"].get("CPU", 0)))
                 for r in records if r.get("Alive", True)]
        return cls(gpus_per_node, nodes, device_memory_gib, f"the Ray cluster at {address or 'RAY_ADDRESS'}: "
                   + ", ".join(f"{n.name} {n.gpus} GPUs / {n.cpus:g} CPUs" for n in nodes), from_ray=True)


@dataclass
class Occupant:
    """One rank (or one TP worker of a vLLM rank) on one device."""
    role: str
    rank: int
    what: str  # e.g. "ZeRO-3 shard 1/4", "vLLM TP rank 1/2"
    parts: Dict[str, float] = field(default_factory=dict)  # estimated bytes; empty: not estimated
    claim: Optional[float] = None  # bytes it takes whatever it needs (vLLM's gpu_memory_utilization)
    claim_key: str = ""
    held: Dict[str, float] = field(default_factory=dict)  # phase -> bytes held (default: all of it)
    capacity: float = 0.0  # the device's bytes, when known

    def need(self) -> float:
        return float(sum(self.parts.values()))

    def holds(self, phase: str) -> float:
        return self.held.get(phase, self.claim if self.claim is not None else self.need())


@dataclass
class Device:
    node: int
    gpu: int
    occupants: List[Occupant] = field(default_factory=list)
    free_share: float = 1.0  # Ray's GPU accounting, for the ranks Ray places

    def peak_phase(self) -> str:
        """The phase in which the device holds most."""
        return max(PHASES, key=lambda phase: sum(o.holds(phase) for o in self.occupants))

    def peak(self) -> Tuple[float, float]:
        """(estimated bytes, claimed bytes) in the phase where the device holds most."""
        phase = self.peak_phase()
        return (sum(o.holds(phase) for o in self.occupants if o.claim is None),
                sum(o.holds(phase) for o in self.occupants if o.claim is not None))


@dataclass
class ClusterPlan:
    cluster: ClusterSpec
    nodes: List[NodeSpec]
    devices: Dict[Tuple[int, int], Device]
    cpu_ranks: List[str]
    problems: List[str]
    notes: List[str]
    routes: List[str] = field(default_factory=list)  # how the weights reach each rollout rank (printable)
    route_problems: List[str] = field(default_factory=list)  # routes the transport cannot take (in problems too)

    def text(self) -> str:
        capacity = (self.cluster.device_memory_gib or 0) * GIB
        used = sorted(key for key, device in self.devices.items() if device.occupants)
        used_nodes = sorted({node for node, _ in used})
        size = f" of {self.cluster.device_memory_gib:g} GiB" if capacity else ""
        if not used and not self.problems:
            return "\n".join(["placement plan: no role uses a GPU; every rank runs on CPUs (Ray picks the node): "
                              + "; ".join(self.cpu_ranks)] + self.routes
                             + [n for n in self.notes if not n.startswith("memory")])
        uses = (f"the roles use {len(used)} GPU(s) on {len(used_nodes)} node(s)"
                + (f": needs {len(used_nodes)} nodes" if len(used_nodes) > 1 else "")) if used else "no role uses a GPU"
        lines = [f"placement plan: {uses}; cluster: {self.cluster.source}" + (f", GPUs{size}" if capacity else "")]
        for index, node in enumerate(self.nodes):
            gpus = sorted(set(range(node.gpus)) | {g for (n, g) in self.devices if n == index})
            node_devices = [self.devices.get((index, g), Device(index, g)) for g in gpus]
            if not any(d.occupants for d in node_devices):
                if self.cluster.nodes is not None and not node.missing:
                    lines.append(f"node {index} ({'' if node.name == f'node {index}' else node.name + ', '}"
                                 f"{node.gpus} GPUs): idle")
                continue
            label = "MISSING: not in the cluster, " if node.missing else (
                "" if node.name == f"node {index}" else f"{node.name}, ")
            lines.append(f"node {index} ({label}{node.gpus} GPUs):")
            idle = []
            for device in node_devices:
                if not device.occupants:
                    idle.append(device.gpu)
                    continue
                estimated, claimed = device.peak()
                total = estimated + claimed
                head = f"  GPU {device.gpu}{' (does not exist)' if device.gpu >= node.gpus else ''}:"
                if any(o.parts or o.claim is not None for o in device.occupants):
                    head += f" {total / GIB:.2f} GiB" + (f" of {capacity / GIB:g} GiB ({total / capacity:.0%})"
                                                        if capacity else "")
                lines.append(head)
                for o in device.occupants:
                    lines.append(f"    {o.role} rank {o.rank} ({o.what}): {_describe_use(o)}")
            if idle:
                lines.append(f"  GPU {_ranges(idle)}: idle")
        if self.cpu_ranks:
            lines.append("on CPUs (Ray picks the node): " + "; ".join(self.cpu_ranks))
        lines += self.routes
        lines += self.notes
        if capacity and not self.problems:
            fullest = max((d for d in self.devices.values() if d.occupants), key=lambda d: sum(d.peak()), default=None)
            if fullest is not None and sum(fullest.peak()) > 0:
                lines.append(f"memory: fits; fullest device node {fullest.node} GPU {fullest.gpu} at "
                             f"{sum(fullest.peak()) / capacity:.0%} of {capacity / GIB:g} GiB (estimates keep a "
                             f"{1 - MARGIN:.0%} margin)")
        return "\n".join(lines)


def _describe_use(o: Occupant) -> str:
    if o.claim is not None:
        claim = f"claims {o.claim / GIB:.2f} GiB (gpu_memory_utilization {o.claim / o.capacity:g})"
        return f"{claim}; needs {o.need() / GIB:.2f} GiB = {_parts(o.parts)}" if o.parts else claim
    if not o.parts:
        return "memory not estimated"
    return f"{o.need() / GIB:.2f} GiB = {_parts(o.parts)}"


def _ranks(count: int) -> str:
    return f"{count} rank" + ("s" if count != 1 else "")


def _parts(parts: Dict[str, float]) -> str:
    return " + ".join(f"{name.replace('_', ' ')} {value / GIB:.2f}" for name, value in parts.items())


def _ranges(values: List[int]) -> str:
    groups: List[str] = []
    start = values[0]
    for prev, cur in zip(values, values[1:] + [None]):
        if cur is None or cur != prev + 1:
            groups.append(f"{start}" if start == prev else f"{start}-{prev}")
            if cur is not None:
                start = cur
    return ", ".join(groups)


# --------------------------------------------------------------------------------------------
# Building the plan
# --------------------------------------------------------------------------------------------
def gpu_roles(cfg: PipelineConfig) -> Dict[str, RoleConfig]:
    """The roles the pipeline starts, by the key that configures them (SFT: the trainer alone;
    rlvr and agentic: the trainer, the rollout engine and the reference when a KL term needs it)."""
    if not cfg.has_rollout():
        return {"actor_train": cfg.actor_train}
    roles = {"actor_train": cfg.actor_train, "actor_infer": cfg.actor_infer}
    if cfg.needs_reference():
        roles["reference"] = cfg.reference
    if cfg.uses_critic() and cfg.critic is not None:
        roles["critic"] = cfg.critic
    if cfg.uses_teacher():  # use_opd: the frozen teacher(s)
        roles.update(cfg.teacher_roles())
    return roles


def gpus_per_rank(role) -> float:
    """Ray GPUs one rank of `role` asks for (validated config: device_mapping ranks are whole)."""
    return float(role.num_gpus_per_worker or 0)


def plan_cluster(cfg: PipelineConfig, cluster: ClusterSpec, shape: Optional[ModelShape] = None) -> ClusterPlan:
    """Place every rank of the config's roles on `cluster` and estimate each device's memory.
    `shape` defaults to the actor model folder's config.json (none: placement only)."""
    from roll_gspo.placement.device_mapping import PlacementError, assign_node_indices, plan_for_roles, reward_roles

    npn = cfg.num_gpus_per_node
    roles = gpu_roles(cfg)
    problems: List[str] = []
    notes: List[str] = []
    described = cluster.nodes is not None
    nodes: List[NodeSpec] = [NodeSpec(n.name, n.gpus, n.cpus) for n in (cluster.nodes or [])]
    devices: Dict[Tuple[int, int], Device] = {}

    def node_at(index: int) -> NodeSpec:
        while len(nodes) <= index:  # a node the described cluster lacks, or one of an undescribed cluster
            nodes.append(NodeSpec(f"node {len(nodes)}",
                                  cluster.gpus_per_node, None, missing=described))
        return nodes[index]

    def device(node: int, gpu: int) -> Device:
        return devices.setdefault((node, gpu), Device(node, gpu))

    # 1. device_mapping roles, where it says
    mapped_rewards = {name: reward for name, reward in reward_roles(cfg).items() if reward.device_mapping is not None}
    try:
        mapped = plan_for_roles({**roles, **mapped_rewards}, npn)
    except PlacementError as exc:  # validated configs do not get here
        return ClusterPlan(cluster, nodes, devices, [], [str(exc)], [])
    where: Dict[int, int] = {}  # node index -> position in `nodes`
    slots_of = mapped.slots if mapped is not None else {}
    if mapped is not None:
        needs = {index: (len(gpus), sum(mapped.bundle_cpus(g) for g in gpus))
                 for index, gpus in mapped.node_gpus().items()}
        if described:
            # A described node k holds node index k (its missing GPUs are named below); Ray's nodes
            # are matched as the run matches them (GpuPlacement.reserve).
            chosen = assign_node_indices(needs, [{"GPU": n.gpus if cluster.from_ray else max(n.gpus, npn),
                                                  "CPU": n.cpus} for n in nodes])
            spare = len(nodes)
            for index in sorted(needs):
                if chosen[index] is None:
                    chosen[index], spare = spare, spare + 1
            where = {i: p for i, p in chosen.items() if p is not None}  # every index has a node now
        else:
            where = {index: index for index in needs}
        for name, slots in mapped.slots.items():
            absent: List[int] = []
            for slot in slots:
                node = node_at(where[slot.node_index])
                for gpu in slot.gpus:
                    if described and (node.missing or gpu % npn >= node.gpus):
                        absent.append(gpu)
                    device(where[slot.node_index], gpu % npn).free_share = 0.0  # the whole GPU is its bundle
            if absent:
                have = sum(n.gpus for n in cluster.nodes or [])
                problems.append(
                    f"{name}.device_mapping names GPUs that do not exist: {_ranges(sorted(absent))} (GPU g is GPU "
                    f"g % {npn} of node index g // {npn}, num_gpus_per_node = {npn}); the cluster has "
                    f"{len(cluster.nodes or [])} node(s) with {', '.join(str(n.gpus) for n in cluster.nodes or [])} "
                    f"GPUs ({have} in all)"
                    + ("; set num_gpus_per_node to the GPUs each node has" if any(
                        n.gpus < npn for n in cluster.nodes or []) else ""))
        node_count = max(where.values()) + 1
        for i in range(node_count):
            node_at(i)
    # 2. the roles Ray places (first fit on what is left)
    placed: Dict[str, List[List[Tuple[int, int]]]] = {}
    for name, role in roles.items():
        if role.device_mapping is not None:
            placed[name] = [[(where[s.node_index], g % npn) for g in s.gpus] for s in slots_of[name]]
        elif gpus_per_rank(role) > 0:
            notes.append(f"{name}: no device_mapping, so Ray places its ranks at run time; shown: first fit")
            placed[name] = []
            for rank in range(role.world_size):
                spot = _first_fit(gpus_per_rank(role), nodes, devices, node_at, cluster.gpus_per_node)
                if spot is None:
                    problems.append(f"{name}: a rank needs {gpus_per_rank(role):g} GPUs on one node "
                                    f"({name}.num_gpus_per_worker) but a node has {cluster.gpus_per_node}")
                    break
                placed[name].append(spot)
    cpu_ranks = [f"{name} {role.world_size} x {role.num_cpus_per_worker:g} CPU" for name, role in roles.items()
                 if name not in placed]
    for domain, reward in (cfg.rewards.items() if cfg.pipeline == "rlvr" else []):
        if reward.device_mapping is not None:  # ROLL's judge GPUs, where the mapping says
            placed[f"rewards.{domain}"] = [[(where[s.node_index], g % npn) for g in s.gpus]
                                           for s in slots_of[f"rewards.{domain}"]]
        elif reward.num_gpus_per_worker:
            fits = [_first_fit(reward.num_gpus_per_worker, nodes, devices, node_at, cluster.gpus_per_node)
                    for _ in range(reward.world_size)]
            placed[f"rewards.{domain}"] = [fit for fit in fits if fit is not None]
            if None in fits:
                problems.append(f"rewards.{domain}: a worker needs {reward.num_gpus_per_worker:g} GPUs on one node "
                                f"(rewards.{domain}.num_gpus_per_worker) but a node has {cluster.gpus_per_node}")
        else:
            cpu_ranks.append(f"rewards.{domain} {reward.world_size} x {reward.num_cpus_per_worker:g} CPU")
    routes, route_problems = _weight_sync_routes(cfg, roles, placed, 0 if described and len(nodes) == 1 else None)
    problems += route_problems
    # 3. what each rank holds on its devices
    shape = shape if shape is not None else shape_of_model_folder(cfg.actor_train.model_args.model_name_or_path or "")
    if shape is None and placed:
        notes.append(f"memory: not estimated (no config.json in "
                     f"{cfg.actor_train.model_args.model_name_or_path!r} to read the model's shape from)")
    capacity = (cluster.device_memory_gib or 0) * GIB
    for name, ranks in placed.items():
        model_role = roles.get(name)
        for rank, rank_spots in enumerate(ranks):
            for tp_rank, (node_index, gpu_index) in enumerate(rank_spots):
                device(node_index, gpu_index).occupants.append(
                    _occupant(cfg, name, model_role, rank, tp_rank, len(rank_spots), shape, capacity)
                    if model_role is not None
                    else _reward_occupant(cfg, name, rank, tp_rank, len(rank_spots), capacity))
    for d in devices.values():
        _phase_holdings(cfg, d)
    # 4. checks against the cluster
    if described:
        problems += _too_small(nodes, devices, roles, placed, cluster)
        cpus_needed = (sum(r.world_size * r.num_cpus_per_worker for r in roles.values())
                       + sum(r.world_size * r.num_cpus_per_worker for r in
                             (cfg.rewards.values() if cfg.pipeline == "rlvr" else [])))
        cpus_have = [n.cpus for n in cluster.nodes or []]
        known = [c for c in cpus_have if c is not None]
        if cpus_have and len(known) == len(cpus_have) and sum(known) + 1e-6 < cpus_needed:
            problems.append(f"the cluster is too small: the roles reserve {cpus_needed:g} CPUs "
                            f"(num_cpus_per_worker x world_size, rewards included), it has {sum(known):g}")
    if capacity and shape is not None:
        problems += _grouped(list(devices.values()), capacity)
    return ClusterPlan(cluster, nodes, devices, cpu_ranks, problems, notes, routes, route_problems)


def _weight_sync_routes(cfg: PipelineConfig, roles, placed: Dict[str, List[List[Tuple[int, int]]]],
                        cpu_node: Optional[int]) -> Tuple[List[str], List[str]]:
    """(printable lines, problems): the route of each rollout rank's weights from actor_train rank 0,
    decided by `weight_routes` from the planned devices as the run decides from the real ones.
    `cpu_node`: the node of ranks without a GPU when the cluster has one node (else unknown)."""
    from roll_gspo.placement.device_mapping import tensor_parallel_size

    if "actor_infer" not in roles:
        return [], []
    transport = cfg.weight_sync_transport

    def gpu(node: int, index: int) -> DevicePlace:
        return DevicePlace(node, index, f"node {node} GPU {index}")

    train = placed.get("actor_train")
    sender = gpu(*train[0][0]) if train else DevicePlace(cpu_node, None, "CPU")
    infer = roles["actor_infer"]
    if "actor_infer" in placed:
        receivers = [(f"actor_infer rank {rank}", [gpu(*spot) for spot in spots])
                     for rank, spots in enumerate(placed["actor_infer"])]
    else:  # on CPU: one weight-holding process per vLLM tensor-parallel worker
        workers = tensor_parallel_size(infer.strategy_args.strategy_config or {}) \
            if infer.strategy_args.engine.spans_gpus else 1
        receivers = [(f"actor_infer rank {rank}", [DevicePlace(cpu_node, None, "CPU")] * workers)
                     for rank in range(infer.world_size)]
    try:
        routes = weight_routes(sender, receivers, transport)
    except WeightRouteError as exc:
        return [], exc.problems
    where = sender.name if sender.gpu is not None else "on CPU"
    return ([f"weight sync (weight_sync_transport: {transport}) from actor_train rank 0 ({where}):"]
            + ["  " + line for line in route_lines(routes)]), []


def weight_route_problems(cfg: PipelineConfig) -> List[str]:
    """`weight_sync_transport: collective` where the planned placement has a rollout worker the
    collective cannot reach (on the sender's GPU, say): refused before any worker starts. The
    placement is the plan's on a cluster of num_gpus_per_node-GPU nodes (config validated)."""
    if cfg.pipeline != "rlvr" or cfg.weight_sync_transport != "collective":
        return []
    return plan_cluster(cfg, ClusterSpec(max(cfg.num_gpus_per_node, 1))).route_problems


def _first_fit(share: float, nodes: List[NodeSpec], devices: Dict[Tuple[int, int], Device], node_at,
               gpus_per_node: int) -> Optional[List[Tuple[int, int]]]:
    """GPUs for one rank asking `share` Ray GPUs: that many whole free GPUs of one node (>= 1) or
    one GPU with that share left (< 1). Takes them; None if no node, even a new one, could."""
    whole = int(math.ceil(share)) if share >= 1 else 1
    need = 1.0 if share >= 1 else share
    # The nodes there are, then one more (a new node of gpus_per_node GPUs, if a rank fits one).
    for index in range(len(nodes) + (1 if whole <= gpus_per_node else 0)):
        node = node_at(index)
        free = [g for g in range(node.gpus) if devices.get((index, g), Device(index, g)).free_share + 1e-9 >= need]
        if len(free) >= whole:
            for g in free[:whole]:
                devices.setdefault((index, g), Device(index, g)).free_share -= need
            return [(index, g) for g in free[:whole]]
    return None


def _occupant(cfg: PipelineConfig, name: str, role, rank: int, tp_rank: int, tp: int, shape: Optional[ModelShape],
              capacity: float) -> Occupant:
    strategy = role.strategy_args.strategy_name
    engine = role.strategy_args.strategy_config or {}
    seq_len = cfg.prompt_length + cfg.response_length
    dtype = role.model_args.dtype
    if role.strategy_args.engine.vllm_engine_args:  # claims its gpu_memory_utilization
        occupant = Occupant(name, rank, "vLLM" + (f", TP worker {tp_rank} of {tp}" if tp > 1 else ""),
                            capacity=capacity)
        utilization, key = vllm_utilization(name, role)
        key += f" = {utilization:g}"
        if capacity:
            occupant.claim, occupant.claim_key = utilization * capacity, key
        if shape is not None:
            occupant.parts = rollout_memory(shape, dtype=dtype, tensor_parallel_size=tp,
                                            max_num_seqs=_rollout_concurrency(cfg, role),
                                            max_model_len=int(engine.get("max_model_len") or seq_len))
        return occupant
    zero = int((engine.get("zero_optimization") or {}).get("stage", 0)) if isinstance(engine, dict) else 0
    if strategy.startswith("fsdp2"):  # weights, gradients and Adam's states sharded: ZeRO-3's memory
        zero = 3
    # The critic is counted as a trainer of the policy's size (its scalar head replaces the LM
    # head: slightly less, so an upper bound).
    if name in ("actor_train", "critic"):
        occupant = Occupant(name, rank, f"{'FSDP2' if strategy.startswith('fsdp2') else f'ZeRO-{zero}'}, "
                                        f"{_ranks(role.world_size)}")
        if shape is not None:
            lora = role.model_args  # LoRA: gradients and Adam's states of the adapter only
            occupant.parts = training_memory(
                shape, dtype=dtype, zero_stage=zero, world_size=role.world_size,
                micro_batch=role.training_args.per_device_train_batch_size, seq_len=seq_len,
                gradient_checkpointing=role.model_args.gradient_checkpointing,
                trainable=lora_parameters(shape, lora.lora_target, lora.lora_rank or 8) if lora.lora_target else None)
        return occupant
    if role.strategy_args.engine.serves_requests and name == "actor_infer":  # a model and its KV cache, no claim
        occupant = Occupant(name, rank, f"{strategy} rollout")
        if shape is not None:
            occupant.parts = rollout_memory(shape, dtype=dtype, tensor_parallel_size=1,
                                            max_num_seqs=_rollout_concurrency(cfg, role), max_model_len=seq_len)
        return occupant
    occupant = Occupant(name, rank, f"{strategy}" + (f", ZeRO-{zero}, {_ranks(role.world_size)}" if zero else ""))
    if shape is not None:
        occupant.parts = frozen_memory(shape, dtype=dtype, zero_stage=zero, world_size=role.world_size,
                                       batch=role.infer_batch_size, seq_len=seq_len)
    return occupant


def _reward_occupant(cfg: PipelineConfig, name: str, rank: int, tp_rank: int, tp: int, capacity: float) -> Occupant:
    """A model-backed reward worker on a GPU, from its own model folder: a vLLM judge claims its
    gpu_memory_utilization and holds weights + KV cache for its share of a batch's verdicts; an
    hf_infer judge or a reward model holds its weights and one scoring pass."""
    reward = cfg.rewards[name.split(".", 1)[1]]
    shape = shape_of_model_folder(reward.model_args.model_name_or_path or "")
    engine = reward.strategy_args.strategy_config or {}
    dtype = reward.model_args.dtype
    batch = math.ceil(cfg.rollout_batch_size * cfg.num_return_sequences_in_group / max(reward.world_size, 1))
    seq_len = cfg.prompt_length + cfg.response_length + int(reward.generating_args.max_new_tokens or 0)
    if reward.strategy_args.engine.vllm_engine_args:  # claims its gpu_memory_utilization
        occupant = Occupant(name, rank, "LLM judge, vLLM" + (f", TP worker {tp_rank} of {tp}" if tp > 1 else ""),
                            capacity=capacity)
        utilization, key = vllm_utilization(name, reward)
        if capacity:
            occupant.claim, occupant.claim_key = utilization * capacity, f"{key} = {utilization:g}"
        if shape is not None:
            occupant.parts = rollout_memory(shape, dtype=dtype, tensor_parallel_size=tp,
                                            max_num_seqs=min(batch, int(engine.get("max_num_seqs") or batch)),
                                            max_model_len=int(engine.get("max_model_len") or 2048))
        return occupant
    occupant = Occupant(name, rank, f"reward model, {reward.strategy_args.strategy_name}")
    if shape is not None:
        occupant.parts = frozen_memory(shape, dtype=dtype, zero_stage=0, world_size=1,
                                       batch=reward.infer_batch_size, seq_len=seq_len)
    return occupant


def vllm_utilization(name: str, role) -> Tuple[float, str]:
    """(share of each device a vLLM rank's workers claim, the key that sets it). Hook: the
    colocation work (issue 15 item 3) may derive a default from the rank's GPU share."""
    engine = role.strategy_args.strategy_config or {}
    key = f"{name}.strategy_args.strategy_config.gpu_memory_utilization"
    if engine.get("gpu_memory_utilization") is not None:
        return float(engine["gpu_memory_utilization"]), key
    return VLLM_DEFAULT_UTILIZATION, key + " (vLLM's default)"


def _rollout_concurrency(cfg: PipelineConfig, role) -> int:
    """Sequences one rollout rank keeps in flight: its part of the batch, at most max_num_seqs."""
    per_rank = math.ceil(cfg.rollout_batch_size * cfg.num_return_sequences_in_group / max(role.world_size, 1))
    limit = (role.strategy_args.strategy_config or {}).get("max_num_seqs")
    return min(per_rank, int(limit)) if limit else per_rank


def _phase_holdings(cfg: PipelineConfig, device: Device) -> None:
    """What each rank on a device shared with the rollout engine holds while the other role works.

    Freeing memory between phases is `is_offload_states` (ROLL's key; null: when actor_infer shares
    a GPU): vLLM sleeps through training (level 1 moves its weights to CPU, level 2 drops them; the
    KV cache goes either way), and actor_train moves its optimizer states and gradients to CPU
    while vLLM generates (its weights too with `offload_train_params`). Without it, every rank
    holds all of it in both phases and colocated roles add up."""
    roles = {o.role for o in device.occupants}
    if "actor_infer" not in roles or len(device.occupants) < 2:
        return
    offload = cfg.is_offload_states
    if offload is None:
        offload = len(roles) > 1
    if not offload:
        return
    for o in device.occupants:
        if o.role == "actor_infer" and o.claim is not None:
            o.held["train"] = 0.0
            o.what += ", asleep while training"
        elif o.role == "actor_train" and o.parts:
            o.held["rollout"] = 0.0 if cfg.offload_train_params else o.parts.get("weights", 0.0)
            o.what += ", states on CPU while generating"


def _memory_problems(device: Device, capacity: float) -> List[str]:
    where = f"node {device.node} GPU {device.gpu}"
    out = []
    for o in device.occupants:
        if o.claim is not None and o.parts and o.need() > o.claim:
            out.append(f"does not fit: {where}: {o.role} rank {o.rank} ({o.what}) needs {o.need() / GIB:.2f} GiB "
                       f"({_parts(o.parts)} GiB) but {o.claim_key} of {capacity / GIB:g} GiB gives it "
                       f"{o.claim / GIB:.2f} GiB: short by {(o.need() - o.claim) / GIB:.2f} GiB (raise it, lower "
                       f"max_num_seqs / max_model_len, or raise tensor_parallel_size)")
    if out or not any(o.parts for o in device.occupants):
        return out
    estimated, claimed = device.peak()
    room = MARGIN * max(capacity - claimed, 0.0)
    if claimed > capacity + 1e-6 or estimated > room + 1e-6:
        over = estimated + claimed - capacity if claimed > capacity else estimated - room
        phase = device.peak_phase()
        freed = any(o.held for o in device.occupants)
        held = ("while generating: " if phase == "rollout" else "while training: ") if freed else ""
        held += " + ".join(f"{o.role} rank {o.rank} " + (
            "asleep 0" if o.claim is not None and not o.holds(phase) else
            f"{'claims ' if o.claim is not None else ''}{o.holds(phase) / GIB:.2f}") for o in device.occupants)
        why = (f"the vLLM claims leave {max(capacity - claimed, 0) / GIB:.2f} GiB, {MARGIN:.0%} of it for the "
               f"estimates" if claimed else f"estimates keep a {1 - MARGIN:.0%} margin: {room / GIB:.2f} GiB usable")
        together = f"; {len(device.occupants)} ranks share this GPU and add up" if len(device.occupants) > 1 else ""
        if len(device.occupants) == 1:
            o = device.occupants[0]
            held = f"{o.role} rank {o.rank} ({o.what}) needs {o.need() / GIB:.2f} GiB ({_parts(o.parts)} GiB)"
        else:
            held += f" = {(estimated + claimed) / GIB:.2f} GiB"
        out.append(f"does not fit: {where} of {capacity / GIB:g} GiB: {held}, over by {over / GIB:.2f} GiB "
                   f"({why}{together})" + _remedies({o.role for o in device.occupants}))
    return out


def _remedies(roles) -> str:
    """The keys that shrink what the roles on an overfull device hold."""
    hints = []
    if "actor_train" in roles:
        hints.append("actor_train: a higher strategy_config.zero_optimization.stage or more ranks, a smaller "
                     "training_args.per_device_train_batch_size, model_args.gradient_checkpointing")
    if "actor_infer" in roles and len(roles) > 1:
        hints.append("actor_infer.strategy_args.strategy_config.gpu_memory_utilization lower, or the roles "
                     "on separate GPUs")
    if "reference" in roles:
        hints.append("reference: ZeRO-3 over more ranks or a smaller infer_batch_size")
    if "critic" in roles:
        hints.append("critic: a higher strategy_config.zero_optimization.stage or more ranks, a smaller "
                     "training_args.per_device_train_batch_size, model_args.gradient_checkpointing")
    return "; to fit: " + "; ".join(hints) if hints else ""


def _grouped(devices: List[Device], capacity: float) -> List[str]:
    """Memory problems, one line for the devices whose occupants need the same (ranks aside)."""
    groups: Dict[tuple, List[Tuple[Device, List[str]]]] = {}
    for d in sorted(devices, key=lambda d: (d.node, d.gpu)):
        problems = _memory_problems(d, capacity)
        if problems:
            same = tuple((o.role, o.what.split(", TP worker")[0], round(o.need()), o.claim) for o in d.occupants)
            groups.setdefault(same, []).append((d, problems))
    out = []
    for members in groups.values():
        first, problems = members[0]
        if len(members) > 1:
            others = ", ".join(f"node {n} GPU {_ranges([d.gpu for d, _ in members[1:] if d.node == n])}"
                               for n in sorted({d.node for d, _ in members[1:]}))
            problems = [problems[0] + f"; the same on {len(members) - 1} more GPU(s): {others}"] + problems[1:]
        out += problems
    return out


def _too_small(nodes: List[NodeSpec], devices, roles, placed, cluster: ClusterSpec) -> List[str]:
    used_nodes = {node for (node, _), d in devices.items() if d.occupants}
    missing = sorted(i for i in used_nodes if nodes[i].missing)
    if not missing:
        return []
    have = [n for n in nodes if not n.missing]
    used = sum(1 for d in devices.values() if d.occupants)
    per_role = ", ".join(f"{name} {len(r)} x {len(r[0]) if r else 0}" for name, r in placed.items())
    return [f"the cluster is too small: the roles need {used} GPUs on {len(used_nodes)} node(s) "
            f"({per_role} GPUs per rank) but it has {sum(n.gpus for n in have)} GPUs on {len(have)} node(s) "
            f"({cluster.source}); what the plan puts on node(s) {_ranges(missing)} has nowhere to go"]
