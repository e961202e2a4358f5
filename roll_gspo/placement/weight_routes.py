"""Which way the trained weights take to each rollout worker: the one decision, pure (no Ray, no torch).

The sending trainer rank (actor_train rank 0) and every process that holds rollout weights (a
rollout rank, or each worker of a tensor-parallel vLLM rank) are described by where they sit: a
node and a GPU (None: on CPU). The run describes them by Ray node id and GPU UUID (so
CUDA_VISIBLE_DEVICES remapping does not matter); `--dry-run` by the planned node index and GPU.
Both ask `weight_routes`, so the plan prints what the run will do.

With `weight_sync_transport: auto`:

* a worker on the sender's own GPU takes each bucket by CUDA IPC (the sender's GPU buffer,
  mapped into the worker's process and copied out): NCCL refuses two members of one group on one
  GPU ("Duplicate GPU detected"), which every colocated run would otherwise hit;
* workers on other GPUs join an NCCL group with the sender, one member per GPU (a second worker
  on a GPU already in the group takes the host route below instead);
* a worker or sender on CPU: one shared-memory segment on the sender's node (when /dev/shm has
  room), Ray's object store across nodes.

`object_store` sends everything through Ray's object store. `collective` puts every worker in one
torch.distributed group: gloo when the sender is on CPU, NCCL when it has a GPU; where that group
cannot form (a worker on the sender's GPU, two workers on one GPU, a CPU worker beside a GPU
sender) the decision refuses with a `WeightRouteError` naming the worker, before any worker starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, List, Optional, Sequence, Tuple

CUDA_IPC = "cuda_ipc"
NCCL = "nccl"
GLOO = "gloo"
SHARED_MEMORY = "shared_memory"
OBJECT_STORE = "object_store"
ROUTE_NAMES = {CUDA_IPC: "CUDA IPC", NCCL: "NCCL collective", GLOO: "gloo collective",
               SHARED_MEMORY: "shared memory", OBJECT_STORE: "Ray object store"}
HOST_ROUTES = (SHARED_MEMORY, OBJECT_STORE)  # through host memory: no device of the receiver involved
GROUP_ROUTES = (NCCL, GLOO)  # members of the weight-sync group
NO_SHM_ROOM = "/dev/shm lacks room for 2 buckets"


class WeightRouteError(ValueError):
    """`weight_sync_transport` asks for a route some worker cannot take; one problem per worker."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class DevicePlace:
    """Where a process holds weights. `node`: any id of its node, None when not known yet (Ray
    picks a CPU rank's node at run time); `gpu`: any id of its GPU unique on that node, None on
    CPU; `name`: how messages name the place (e.g. "node 0 GPU 3")."""
    node: Optional[Hashable]
    gpu: Optional[Hashable] = None
    name: str = ""

    def same_gpu(self, other: "DevicePlace") -> bool:
        return self.gpu is not None and other.gpu is not None and (self.node, self.gpu) == (other.node, other.gpu)

    def same_node(self, other: "DevicePlace") -> Optional[bool]:
        """Whether both sit on one node; None when either node is not known yet."""
        return None if self.node is None or other.node is None else self.node == other.node


@dataclass(frozen=True)
class WeightRoute:
    """How one weight-holding process gets the buckets. `receiver` names it (e.g. "actor_infer
    rank 0" or "actor_infer rank 0 TP worker 1"); `why` says what decided it."""
    receiver: str
    kind: str
    why: str

    def __str__(self) -> str:
        return f"{self.receiver} <- {ROUTE_NAMES[self.kind]} ({self.why})"


def weight_routes(sender: DevicePlace, receivers: Sequence[Tuple[str, Sequence[DevicePlace]]], transport: str, *,
                  shared_memory: bool = True, sender_name: str = "actor_train rank 0") -> List[List[WeightRoute]]:
    """The route of every weight-holding worker, per rollout rank.

    `receivers`: per rollout rank, its name and where each of its workers sits (one per vLLM
    tensor-parallel worker; a rank of one worker is named without a worker index).
    `transport`: `weight_sync_transport` (auto, object_store or collective). `shared_memory`:
    whether /dev/shm on the sender's node has room for the segment. Raises WeightRouteError
    where `collective` cannot reach a worker.
    """
    named = [[(name if len(places) == 1 else f"{name} TP worker {index}", place)
              for index, place in enumerate(places)] for name, places in receivers]
    if transport == "object_store":
        return [[WeightRoute(who, OBJECT_STORE, "weight_sync_transport: object_store") for who, _ in rank]
                for rank in named]
    if transport == "collective":
        return _forced_collective(sender, named, sender_name)
    if transport != "auto":
        raise ValueError(f"weight_sync_transport must be auto, object_store or collective, got {transport!r}")
    group: dict = {}  # (node, gpu) -> the worker that holds that GPU's place in the NCCL group
    out = []
    for rank in named:
        routes = []
        for who, place in rank:
            if sender.gpu is None or place.gpu is None:
                routes.append(_host_route(who, sender, place, shared_memory, sender_name))
            elif place.same_gpu(sender):
                routes.append(WeightRoute(who, CUDA_IPC, f"same GPU as {sender_name}"))
            elif (place.node, place.gpu) in group:
                routes.append(_host_route(who, sender, place, shared_memory, sender_name,
                                          f"its GPU is in the NCCL group already, by {group[place.node, place.gpu]}"))
            else:
                group[place.node, place.gpu] = who
                routes.append(WeightRoute(who, NCCL, f"{_other_gpu(place, sender)} than {sender_name}"))
        out.append(_one_kind_of_route_per_rank(routes, sender, rank, shared_memory, sender_name))
    return out


def _host_route(who: str, sender: DevicePlace, place: DevicePlace, shared_memory: bool, sender_name: str,
                because: str = "") -> WeightRoute:
    """Shared memory on the sender's node, Ray's object store elsewhere."""
    lead = f"{because}; " if because else ""
    same = place.same_node(sender)
    if same is False:
        return WeightRoute(who, OBJECT_STORE, f"{lead}another node than {sender_name}")
    if not shared_memory:
        return WeightRoute(who, OBJECT_STORE, f"{lead}{NO_SHM_ROOM}")
    if same is None:
        return WeightRoute(who, SHARED_MEMORY, f"{lead}if Ray starts it on {sender_name}'s node; Ray object "
                                               f"store otherwise")
    return WeightRoute(who, SHARED_MEMORY, f"{lead}same node as {sender_name}")


def _one_kind_of_route_per_rank(routes: List[WeightRoute], sender: DevicePlace, rank, shared_memory: bool,
                                sender_name: str) -> List[WeightRoute]:
    """A rollout rank takes a bucket either through host memory or on its devices, not both: if
    one of its workers must use the host route, all of them do."""
    if not any(r.kind in HOST_ROUTES for r in routes) or all(r.kind in HOST_ROUTES for r in routes):
        return routes
    return [r if r.kind in HOST_ROUTES else _host_route(
        r.receiver, sender, place, shared_memory, sender_name, "a worker of its rank takes the host route")
            for r, (_, place) in zip(routes, rank)]


def _other_gpu(place: DevicePlace, sender: DevicePlace) -> str:
    return "a GPU on another node" if place.same_node(sender) is False else "another GPU"


def _forced_collective(sender: DevicePlace, named, sender_name: str) -> List[List[WeightRoute]]:
    backend = NCCL if sender.gpu is not None else GLOO
    why = (f"weight_sync_transport: collective; {sender_name} is on a GPU" if backend == NCCL else
           f"weight_sync_transport: collective; {sender_name} is on CPU")
    problems: List[str] = []
    taken: dict = {}  # (node, gpu) -> the worker holding that GPU's place in the group
    for rank in named:
        for who, place in rank:
            if backend == GLOO:
                continue
            if place.gpu is None:
                problems.append(f"weight_sync_transport: collective: {who} has no GPU, but {sender_name} sends "
                                f"from one, so the group is NCCL, which a CPU process cannot join; use auto "
                                f"(shared memory / object store for it) or object_store")
            elif place.same_gpu(sender):
                problems.append(f"weight_sync_transport: collective: {who} shares {place.name or 'its GPU'} with "
                                f"{sender_name}; NCCL refuses two members of one group on one GPU (\"Duplicate GPU "
                                f"detected\"); use auto (CUDA IPC for it) or object_store")
            elif (place.node, place.gpu) in taken:
                problems.append(f"weight_sync_transport: collective: {who} shares {place.name or 'its GPU'} with "
                                f"{taken[place.node, place.gpu]}; NCCL refuses two members of one group on one GPU; "
                                f"use auto (the second takes the host route) or object_store")
            else:
                taken[place.node, place.gpu] = who
    if problems:
        raise WeightRouteError(problems)
    return [[WeightRoute(who, backend, why) for who, _ in rank] for rank in named]


def route_lines(routes: Sequence[Sequence[WeightRoute]]) -> List[str]:
    """One line per rollout rank whose workers share a route (its TP workers counted), else one
    per worker."""
    lines = []
    for rank in routes:
        if len(rank) > 1 and len({(r.kind, r.why) for r in rank}) == 1:
            name = rank[0].receiver.rsplit(" TP worker ", 1)[0]
            lines.append(str(WeightRoute(f"{name} ({len(rank)} TP workers)", rank[0].kind, rank[0].why)))
        else:
            lines += [str(r) for r in rank]
    return lines
