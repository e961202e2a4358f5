"""Weight sync through a torch.distributed group of its own (`weight_sync_transport: collective`).

The group joins the training rank that sends (rank 0 of the group) and every rollout worker
process that holds weights (each vLLM tensor-parallel worker is one member, ranks 1..N). It is
not DeepSpeed's group and not vLLM's: it is built from its own TCPStore, hosted by the sender,
and a backend process group constructed directly on it (gloo on CPU, NCCL on GPUs), so it can
span processes of different "worlds" (the trainer's and the rollout engines').

A bucket travels as one flat byte buffer: the sender packs the bucket's tensors (64-byte
aligned), broadcasts it once, and each receiver unpacks views by the layout it got (through Ray,
with the `load_weight_bucket` call) beforehand. Every collective has a deadline
(`weight_sync_timeout_s`): a member that died or stopped answering makes the broadcast fail with
a `WeightSyncError` naming the group, never a hang.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

ALIGN = 64  # bytes; every tensor starts on a cache line
GROUP_PREFIX = "roll_gspo_weight_sync"


class WeightSyncError(RuntimeError):
    """A weight broadcast (or the group's set-up) failed or ran past its deadline."""


@dataclass(frozen=True)
class CollectiveBucket:
    """What travels through Ray for a broadcast bucket: the flat buffer's size in bytes and where
    each tensor lies in it (name, byte offset, byte count, shape, dtype name)."""
    nbytes: int
    layout: Tuple[Tuple[str, int, int, Tuple[int, ...], str], ...]


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

    def send(self, bucket: Sequence[Tuple[str, torch.Tensor]], meta: CollectiveBucket) -> None:
        self.broadcast(pack_bucket(bucket, meta, self.device))

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


def group_backend() -> str:
    """NCCL where the sender trains on a GPU, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class CollectiveReceiver:
    """A rollout worker's end: joins the group when asked, then receives buckets."""

    def __init__(self):
        self.group: Optional[WeightGroup] = None

    def join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.group = WeightGroup(host, port, rank, world_size, timeout_s, backend)

    def receive(self, meta: CollectiveBucket) -> List[Tuple[str, torch.Tensor]]:
        if self.group is None:
            raise WeightSyncError("a collective weight bucket arrived before this rollout worker joined the "
                                  "weight-sync group")
        return self.group.receive(meta)


class CollectiveSender:
    """The sending training rank's end: forms the group with every rollout rank's workers, then
    broadcasts each bucket after telling the receivers (through Ray) what to expect."""

    def __init__(self, receivers: Sequence, timeout_s: float):
        import ray

        from roll_gspo.distributed.cluster import free_port, node_address

        self.receivers, self.timeout_s = list(receivers), timeout_s
        counts = self._wait([r.weight_receivers.remote() for r in self.receivers], "report their worker count")
        world_size = 1 + sum(counts)
        host, port, backend = node_address(), free_port(), group_backend()
        joins, first_rank = [], 1
        for receiver, count in zip(self.receivers, counts):
            joins.append(receiver.join_weight_group.remote(host, port, first_rank, world_size, timeout_s, backend))
            first_rank += count
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
        stamp = {"version": version} if version is not None else {}  # only the last bucket has one
        calls = [r.load_weight_bucket.remote(meta, first=first, last=last, **stamp) for r in self.receivers]
        self.group.send(bucket, meta)
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
