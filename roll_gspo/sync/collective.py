"""Weight sync on devices: a torch.distributed group of its own, and CUDA IPC on the sender's GPU.

The group joins the training rank that sends (rank 0 of the group) and the rollout worker
processes whose route (roll_gspo.placement.weight_routes) is a collective: every worker with
`weight_sync_transport: collective`; with `auto` on GPUs, the workers on other GPUs than the
sender's, one per GPU (each vLLM tensor-parallel worker is one member, ranks 1..N). It is not
DeepSpeed's group and not vLLM's: it is built from its own TCPStore, hosted by the sender, and a
backend process group constructed directly on it (gloo on CPU, NCCL on GPUs), so it can span
processes of different "worlds" (the trainer's and the rollout engines'). Workers on the sender's
own GPU, which NCCL refuses as members, map the same packed buffer by CUDA IPC
(roll_gspo.sync.cuda_ipc) instead.

A bucket travels as one flat byte buffer: the sender packs the bucket's tensors (64-byte
aligned), broadcasts it once (and shares it by CUDA IPC where a worker is on its GPU), and each
receiver unpacks views by the layout it got (through Ray, with the `load_weight_bucket` call)
beforehand. Every collective has a deadline
(`weight_sync_timeout_s`): a member that died or stopped answering makes the broadcast fail with
a `WeightSyncError` naming the group, never a hang.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch

from roll_gspo.placement.weight_routes import CUDA_IPC, GROUP_ROUTES, NCCL
from roll_gspo.sync.cuda_ipc import SharedCudaBuffer, copy_shared_buffer, gpu_identity, share_buffer

ALIGN = 64  # bytes; every tensor starts on a cache line
GROUP_PREFIX = "roll_gspo_weight_sync"


class WeightSyncError(RuntimeError):
    """A weight broadcast (or the group's set-up) failed or ran past its deadline; `unresponsive`:
    the receivers (their indices) found stopped or hung, when that is why."""

    def __init__(self, message: str, unresponsive: Sequence[int] = ()):
        super().__init__(message)
        self.unresponsive = list(unresponsive)

    def __reduce__(self):
        return type(self), (str(self), self.unresponsive)


@dataclass(frozen=True)
class CollectiveBucket:
    """What travels through Ray for a broadcast bucket: the flat buffer's size in bytes and where
    each tensor lies in it (name, byte offset, byte count, shape, dtype name); `ipc`, when some
    worker is on the sender's GPU, the handle that worker maps the buffer by."""
    nbytes: int
    layout: Tuple[Tuple[str, int, int, Tuple[int, ...], str], ...]
    ipc: Optional[SharedCudaBuffer] = None


def bucket_layout(bucket: Sequence[Tuple[str, torch.Tensor]]) -> CollectiveBucket:
    layout, size = [], 0
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((name, size, nbytes, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
        size += -(-nbytes // ALIGN) * ALIGN
    return CollectiveBucket(max(size, ALIGN), tuple(layout))


def pack_bucket(bucket: Sequence[Tuple[str, torch.Tensor]], meta: CollectiveBucket, device) -> torch.Tensor:
    """The bucket's tensors as one uint8 buffer (nbytes,) on `device`, laid out as `meta` says."""
    flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
    for (_, tensor), (_, offset, nbytes, _, _) in zip(bucket, meta.layout):
        if nbytes:
            flat[offset:offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def unpack_bucket(flat: torch.Tensor, meta: CollectiveBucket) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) views into `flat` (a fresh buffer per bucket, so loaders may keep them)."""
    out = []
    for name, offset, nbytes, shape, dtype_name in meta.layout:
        raw = flat[offset:offset + nbytes]
        out.append((name, raw.view(getattr(torch, dtype_name)).view(shape)))
    return out


class WeightGroup:
    """One member of the weight-sync group. Rank 0 hosts the store and sends; construction is
    itself collective (every member must construct it within `timeout_s`)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str):
        from torch.distributed import PrefixStore, TCPStore

        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.where = f"weight-sync group at {host}:{port} (rank {rank} of {world_size}, {backend})"
        try:
            store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=self.timeout,
                             wait_for_workers=False)
            self.group = _backend_group(PrefixStore(GROUP_PREFIX, store), rank, world_size, self.timeout, backend)
            self.store = store  # kept alive with the group (rank 0 serves it)
            # A first broadcast, so that a member missing from the group shows up now, not mid-sync.
            self.broadcast(torch.zeros(1, device=self.device))
        except WeightSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises plain RuntimeErrors/DistStoreErrors
            raise WeightSyncError(f"{self.where}: set-up failed within {timeout_s:g} s ({exc}); every rollout "
                                  f"worker must join (weight_sync_timeout_s bounds the wait)") from exc

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` in place from rank 0, raising WeightSyncError past the deadline."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        options.timeout = self.timeout
        try:
            work = self.group.broadcast([tensor], options)
            work.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001
            raise WeightSyncError(
                f"{self.where}: broadcast of {tensor.numel() * tensor.element_size() / (1 << 20):.1f} MB failed "
                f"({str(exc).splitlines()[0][:300]}); a rollout worker (or the sending trainer rank) died or "
                f"stopped answering within weight_sync_timeout_s = {self.timeout.total_seconds():g} s") from exc

    def receive(self, meta: CollectiveBucket) -> List[Tuple[str, torch.Tensor]]:
        flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        self.broadcast(flat)
        return unpack_bucket(flat, meta)


def _backend_group(store, rank: int, world_size: int, timeout: datetime.timedelta, backend: str):
    if backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout  # noqa: SLF001 - the constructor takes the deadline through Options
        return ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight-sync group backend must be gloo or nccl, got {backend!r}")


class CollectiveReceiver:
    """A rollout worker's end: joins the group when asked, then receives buckets (by CUDA IPC
    when it sits on the sender's GPU)."""

    def __init__(self):
        self.group: Optional[WeightGroup] = None

    def join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.group = WeightGroup(host, port, rank, world_size, timeout_s, backend)

    def receive(self, meta: CollectiveBucket) -> List[Tuple[str, torch.Tensor]]:
        # The sender's route for a worker on its own GPU is CUDA IPC, for any other a group member.
        if meta.ipc is not None and gpu_identity() == meta.ipc.gpu:
            return unpack_bucket(copy_shared_buffer(meta.ipc), meta)
        if self.group is None:
            raise WeightSyncError("a collective weight bucket arrived before this rollout worker joined the "
                                  "weight-sync group")
        return self.group.receive(meta)


def group_members(routes: Sequence[Sequence[str]]) -> List[List[Optional[int]]]:
    """Per rollout rank, the group rank of each of its workers (None: not a member), numbered
    1..N in order; `routes`: each worker's route kind."""
    members, next_rank = [], 1
    for kinds in routes:
        ranks = []
        for kind in kinds:
            ranks.append(next_rank if kind in GROUP_ROUTES else None)
            next_rank += kind in GROUP_ROUTES
        members.append(ranks)
    return members


class CollectiveSender:
    """The sending training rank's end for the rollout ranks whose workers take buckets on their
    devices: forms the group with the workers routed through it, shares each bucket by CUDA IPC
    with those on its own GPU, and broadcasts to the group after telling the receivers (through
    Ray) what to expect. `routes`: per receiver, each of its workers' route kind
    (roll_gspo.placement.weight_routes: CUDA IPC, NCCL or gloo)."""

    def __init__(self, receivers: Sequence, routes: Sequence[Sequence[str]], timeout_s: float):
        import ray

        from roll_gspo.distributed.cluster import free_port, node_address

        self.receivers, self.timeout_s = list(receivers), timeout_s
        kinds = {kind for worker_kinds in routes for kind in worker_kinds}
        self.by_ipc = CUDA_IPC in kinds
        backend = "nccl" if NCCL in kinds else "gloo"
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.by_ipc or backend == "nccl"
                       else torch.device("cpu"))
        self.group: Optional[WeightGroup] = None
        members = group_members(routes)
        world_size = 1 + sum(rank is not None for ranks in members for rank in ranks)
        if world_size == 1:  # every worker is on the sender's GPU: no group
            return
        host, port = node_address(), free_port()
        joins = []
        for receiver, ranks in zip(self.receivers, members):
            joined = [rank for rank in ranks if rank is not None]
            if not joined:
                continue
            args = (host, port, joined[0], world_size, timeout_s, backend)
            # Consecutive ranks are implied; a rank whose workers are not all members says which are.
            extra = {} if len(joined) == len(ranks) else {"members": ranks}
            joins.append(receiver.join_weight_group.remote(*args, **extra))
        try:
            self.group = WeightGroup(host, port, 0, world_size, timeout_s, backend)
        except WeightSyncError:
            ray.wait(joins, timeout=0)  # the receivers' own errors, if any, say more: surface them
            self._wait(joins, "join the weight-sync group")
            raise
        self._wait(joins, "join the weight-sync group")

    def send(self, bucket: Sequence[Tuple[str, torch.Tensor]], first: bool, last: bool,
             version: Optional[int] = None) -> None:
        meta = bucket_layout(bucket)
        flat = pack_bucket(bucket, meta, self.device)
        if self.by_ipc:
            meta = replace(meta, ipc=share_buffer(flat))
        stamp = {"version": version} if version is not None else {}  # only the last bucket has one
        calls = [r.load_weight_bucket.remote(meta, first=first, last=last, **stamp) for r in self.receivers]
        if self.group is not None:
            self.group.broadcast(flat)
        # `flat` stays alive until here: every receiver, those mapping it by CUDA IPC included, has copied it.
        self._wait(calls, "load a broadcast weight bucket")

    def _wait(self, refs, what: str) -> list:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WeightSyncError(f"weight sync: rollout ranks did not {what} within weight_sync_timeout_s = "
                                  f"{self.timeout_s:g} s") from None
        except ray.exceptions.RayActorError as exc:
            raise WeightSyncError(f"weight sync: a rollout rank died while asked to {what} ({exc})") from exc
