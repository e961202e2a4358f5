"""Weight sync: trained weights -> every rollout rank, in bounded buckets.

`broadcast_weights` is the one function that does it. Rank 0 of the trainer sends each bucket
to each rollout worker by the route `roll_gspo.placement.weight_routes` picks for it from where
both sit (the decision `--dry-run` prints):

* shared memory, to CPU rollout ranks on its own node: the bucket is copied into one segment that
  every bucket of a sync reuses and that is freed after the sync; the receivers load from it (in
  place, or copied out where the loader keeps tensors). No Ray object store (a put of a few MB
  costs 1-20 ms of raylet round trips on a busy CPU box, against 0.1 ms for the copy);
* Ray's object store, to CPU rollout ranks on other nodes (and to all of them with
  `weight_sync_transport: object_store`), as numpy arrays;
* on GPUs, CUDA IPC to workers on the sender's own GPU and an NCCL broadcast to those on other
  GPUs; with `weight_sync_transport: collective`, a torch.distributed broadcast to every rollout
  worker (both: `roll_gspo.sync.collective`).
How a bucket then reaches each worker of a tensor-parallel vLLM engine: `strategies/vllm_tp.py`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray
import torch

from roll_gspo.distributed.batch import from_wire, to_wire
from roll_gspo.placement.weight_routes import (HOST_ROUTES, NO_SHM_ROOM, OBJECT_STORE, SHARED_MEMORY, DevicePlace,
                                               route_lines, weight_routes)
from roll_gspo.sync.cuda_ipc import gpu_identity

logger = logging.getLogger("roll_gspo.sync.broadcast")
ALIGN = 64  # bytes; every tensor starts on a cache line


def broadcast_weights(strategy, bucket_bytes: int, sender: Optional["WeightSender"],
                      version: Optional[int] = None) -> Dict[str, float]:
    """Send `strategy`'s full weights to every rollout worker of `sender`.

    Runs on every training rank at once: under ZeRO-3 each bucket is gathered collectively
    (`strategy.iter_weight_buckets`), so at most one bucket of full weights is materialised at a
    time; rank 0 (the one with a `sender`) delivers each bucket to every rollout rank
    (`load_weight_bucket`) before the next bucket is gathered. The first bucket opens the rollout
    engine's update session, the last closes it (and drops caches computed with the old
    weights) and stamps the receivers with `version` (the pipeline step of these weights), which
    their rollouts then carry. Returns timing metrics.
    """
    start = time.perf_counter()
    sent_bytes, buckets = 0, 0
    pending = None  # each bucket is sent once the next one is known, so the last can say so
    lost = None  # why a receiver was lost: the buckets after it are still gathered (ZeRO-3's
    # collective), not sent, and the caller is told (`RECEIVER_LOST`)
    for bucket in strategy.iter_weight_buckets(bucket_bytes):
        if sender is None:
            continue
        if pending is not None and lost is None:
            lost = _send_or_lost(sender, pending, first=buckets == 1, last=False)
        pending = bucket
        sent_bytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        buckets += 1
    if sender is not None and pending is not None and lost is None:
        lost = _send_or_lost(sender, pending, first=buckets == 1, last=True, version=version)
    metrics: Dict[str, Any] = {"sync/seconds": time.perf_counter() - start, "sync/megabytes": sent_bytes / (1 << 20),
                               "sync/buckets": float(buckets)}
    if lost is not None:
        metrics.update(lost)
    return metrics


# The key of a sync's result that says a rollout rank died or hung during it (its text): the
# driver replaces the rank and syncs again (roll_gspo.distributed.replaceable).
RECEIVER_LOST = "receiver_lost"


def receiver_lost(exc: BaseException) -> bool:
    """Whether a failed send means a receiving rank died or stopped answering (not a bug it raised)."""
    from roll_gspo.sync.collective import WeightSyncError

    if isinstance(exc, ray.exceptions.RayTaskError) and not isinstance(exc, ray.exceptions.RayActorError):
        return False
    return isinstance(exc, (ray.exceptions.RayActorError, WeightSyncError, ray.exceptions.GetTimeoutError))


# Beside `RECEIVER_LOST`: the indices (among the sync's receivers) of the rollout ranks found
# unresponsive during it, which the driver replaces without probing them again.
UNRESPONSIVE_RECEIVERS = "unresponsive_receivers"


def lost_fields(exc: BaseException) -> Dict[str, Any]:
    """A sync result's `RECEIVER_LOST` (why, one line) and `UNRESPONSIVE_RECEIVERS` for `exc`."""
    text = str(exc).strip()
    fields: Dict[str, Any] = {RECEIVER_LOST: f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"}
    unresponsive = getattr(exc, "unresponsive", None)  # a WeightSyncError's
    if unresponsive:
        fields[UNRESPONSIVE_RECEIVERS] = list(unresponsive)
    return fields


def _send_or_lost(sender: "WeightSender", bucket, **kwargs) -> Optional[Dict[str, Any]]:
    """Send one bucket; `lost_fields` when a receiver was lost during it (other failures raise)."""
    try:
        sender.send(bucket, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - sorted by receiver_lost
        if not receiver_lost(exc):
            raise
        sender.close()
        return lost_fields(exc)


def broadcast_adapter(strategy, receivers: Optional[Sequence[Any]], config: Dict[str, Any],
                      version: Optional[int] = None, timeout_s: float = 600.0,
                      hang_timeout_s: Optional[float] = None) -> Dict[str, float]:
    """`lora_sync: adapter`: send `strategy`'s LoRA adapter (its tensors under PEFT's names, and its
    adapter_config.json content `config`) to every rollout worker, which loads it as a new LoRA
    request (`load_adapter`). Runs on every training rank at once (the adapter is gathered
    collectively under ZeRO-3); rank 0, the one given `receivers`, sends it through Ray's object
    store: one put of a few MB, whatever the route of the full weights."""
    start = time.perf_counter()
    tensors = [pair for bucket in strategy.iter_weight_buckets(1 << 62, adapter=True) for pair in bucket]
    if receivers is None:
        return {"sync/seconds": time.perf_counter() - start}
    ref = ray.put([(name, *to_wire(tensor)) for name, tensor in tensors])
    await_loads({r.load_adapter.remote(ref, config, version): r for r in receivers}, receivers, timeout_s,
                hang_timeout_s)
    return {"sync/seconds": time.perf_counter() - start,
            "sync/megabytes": sum(t.numel() * t.element_size() for _, t in tensors) / (1 << 20),
            "sync/buckets": 1.0}


class WeightSender:
    """Rank 0's end of weight sync: picks each receiver's route once, then delivers buckets.

    Each receiver (a rollout rank's actor) says where its weight-holding workers sit: its node
    (`node_id`) and each worker's GPU UUID (`weight_gpus`; a receiver without that method holds
    its weights on CPU, `weight_receivers` of them)."""

    def __init__(self, receivers: Sequence[Any], transport: str, bucket_bytes: int, timeout_s: float = 600.0,
                 hang_timeout_s: Optional[float] = None):
        receivers = list(receivers)
        self.timeout_s = timeout_s
        # With it, each bucket's loads are awaited probing the receivers (`_await_loads`).
        self.hang_timeout_s = hang_timeout_s
        self.receivers = receivers
        sender = _place(ray.get_runtime_context().get_node_id(), gpu_identity())
        nodes = ray.get([r.node_id.remote() for r in receivers])
        gpus = [g if isinstance(g, list) else [None] * g for g in ray.get(
            [r.weight_gpus.remote() if hasattr(r, "weight_gpus") else r.weight_receivers.remote() for r in receivers])]
        places = [(f"actor_infer rank {index}", [_place(node, gpu) for gpu in worker_gpus])
                  for index, (node, worker_gpus) in enumerate(zip(nodes, gpus))]
        room = transport == "auto" and shared_memory_available(2 * bucket_bytes)
        routes = weight_routes(sender, places, transport, shared_memory=room)
        for line in route_lines(routes):
            logger.info("weight sync: %s", line)
        if any(NO_SHM_ROOM in r.why for rank in routes for r in rank):
            logger.warning("weight sync: /dev/shm lacks room for 2 buckets of %.0f MB; using Ray's object store",
                           bucket_bytes / (1 << 20))
        # A rank's workers take one kind of route (weight_routes), host or device.
        kind = [rank[0].kind for rank in routes]
        self.by_shared_memory = [r for r, k in zip(receivers, kind) if k == SHARED_MEMORY]
        self.by_object_store = [r for r, k in zip(receivers, kind) if k == OBJECT_STORE]
        self.segment = SharedSegmentWriter() if self.by_shared_memory else None
        on_devices = [(r, [route.kind for route in rank]) for r, rank in zip(receivers, routes)
                      if rank[0].kind not in HOST_ROUTES]
        self.collective = None
        if on_devices:
            from roll_gspo.sync.collective import CollectiveSender

            self.collective = CollectiveSender([r for r, _ in on_devices], [k for _, k in on_devices], timeout_s)

    def send(self, bucket: List[Tuple[str, torch.Tensor]], first: bool, last: bool,
             version: Optional[int] = None) -> None:
        calls: Dict[Any, Any] = {}  # load call -> its receiver
        stamp = {"version": version} if version is not None else {}  # only the last bucket has one
        if self.by_shared_memory:
            shared = self.segment.write(bucket)
            calls.update({r.load_weight_bucket.remote(shared, first=first, last=last, **stamp): r
                          for r in self.by_shared_memory})
        if self.by_object_store:
            ref = ray.put([(name, *to_wire(tensor)) for name, tensor in bucket])
            calls.update({r.load_weight_bucket.remote(ref, first=first, last=last, **stamp): r
                          for r in self.by_object_store})
        if self.collective is not None:  # while the host routes' loads run
            self.collective.send(bucket, first, last, version)
        await_loads(calls, self.receivers, self.timeout_s, self.hang_timeout_s)
        if self.segment is not None:
            self.segment.delivered()
            if last:  # the receivers unmap it too: between syncs no segment holds a bucket of the node's memory
                self.segment.close()


    def close(self) -> None:
        """Let go of the shared segment (a sync cut short by a lost receiver leaves it linked)."""
        if self.segment is not None:
            self.segment.close()


def await_loads(calls: Dict[Any, Any], receivers: Sequence[Any], timeout_s: float,
                hang_timeout_s: Optional[float]) -> None:
    """Until every load call of `calls` (-> its receiver, one of `receivers`) returned; raises as
    soon as one fails. Bounded by `timeout_s` in all, and with `hang_timeout_s` by each receiver's
    health: one that leaves a probe (`health`) unanswered that long (stopped, or hung in native
    code) fails the sync at once, naming it (`WeightSyncError.unresponsive`, its index in
    `receivers`), as the driver's probes judge a rollout rank anywhere else; a slow but answering
    one is waited for."""
    if hang_timeout_s is None:
        try:
            ray.get(list(calls), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise _timeout_error(timeout_s) from None
        return
    from roll_gspo.distributed.fault_tolerance import HangWatch, probe_interval_s

    receivers = list(receivers)
    start = time.monotonic()
    watches: Dict[int, HangWatch] = {}
    probes: Dict[int, Any] = {}
    pending = list(calls)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=probe_interval_s(hang_timeout_s))
        if ready:
            ray.get(ready[0])  # a receiver that died or raised: now, not after its peers
            continue
        now = time.monotonic()
        if now - start > timeout_s:
            raise _timeout_error(timeout_s)
        waiting = {receivers.index(calls[ref]): ref for ref in pending}
        for index in [index for index in watches if index not in waiting]:  # loaded meanwhile
            watches.pop(index)
            probes.pop(index, None)
        for index, ref in waiting.items():
            watch = watches.setdefault(index, HangWatch(hang_timeout_s, started=start))
            probe = probes.get(index)
            if probe is not None and ray.wait([probe], timeout=0)[0]:
                watch.answered(now, 0, 0)  # answering: loading, however slowly
                probes.pop(index)
            if index not in probes:
                probes[index] = calls[ref].health.remote()
                watch.probe_sent(now)
        silent = sorted(index for index, watch in watches.items() if watch.verdict(now))
        if silent:
            raise _unresponsive_error(silent, hang_timeout_s, now - start)


def _unresponsive_error(unresponsive: List[int], hang_timeout_s: float, waited_s: float):
    """The error of a sync whose receivers `unresponsive` (indices: their ranks in a sync of every
    rollout rank) stopped answering health probes while loading a bucket."""
    from roll_gspo.sync.collective import WeightSyncError

    who = ", ".join(f"actor_infer rank {index}" for index in unresponsive)
    return WeightSyncError(f"{who} is unresponsive (stopped or hung, not dead): it did not answer a health probe "
                           f"within fault_tolerance.hang_timeout_s = {hang_timeout_s:g} s while loading a weight "
                           f"bucket ({waited_s:.0f} s into the load)", unresponsive)


def _timeout_error(timeout_s: float):
    from roll_gspo.sync.collective import WeightSyncError

    return WeightSyncError(f"weight sync: rollout ranks did not load a weight bucket within weight_sync_timeout_s = "
                           f"{timeout_s:g} s")


def _place(node: str, gpu: Optional[str]) -> DevicePlace:
    return DevicePlace(node, gpu, f"GPU {gpu}" if gpu else "CPU")


def receive_bucket(payload, reader: "SharedSegmentReader", copy: bool = True) -> List[Tuple[str, torch.Tensor]]:
    """A rollout rank's tensors of one bucket, whichever transport brought it. `copy=False`: a
    shared-memory bucket's tensors are views of the segment, valid until the call that loads them
    returns (the sender writes the next bucket only then)."""
    if isinstance(payload, SharedBucket):
        return reader.read(payload, copy=copy)
    return [(name, from_wire(array, tag)) for name, array, tag in payload]


# -- shared memory ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedBucket:
    """What travels through Ray for a shared-memory bucket: the segment's name and where each
    tensor lies in it (name, byte offset, byte count, shape, dtype name), and the writing process."""
    segment: str
    layout: Tuple[Tuple[str, int, int, Tuple[int, ...], str], ...]
    writer_pid: int


def shared_memory_available(min_free_bytes: int) -> bool:
    """/dev/shm exists and has room (containers often mount 64 MB there; writing past it would
    kill the process with SIGBUS, not raise)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= min_free_bytes


class SharedSegmentWriter:
    """One shared-memory segment, reused by every bucket of a sync and replaced only when a bucket
    outgrows it; closed after the sync's last bucket (`close`), made again by the next sync.

    Its name is unlinked once the receivers have opened it: the memory then lives exactly as long
    as the processes that map it, so nothing is left in /dev/shm whatever way they end.
    """

    def __init__(self):
        self.segment: Optional[shared_memory.SharedMemory] = None
        self.linked = False

    def write(self, bucket: List[Tuple[str, torch.Tensor]]) -> SharedBucket:
        layout, size = [], 0
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            layout.append((name, size, nbytes, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
            size += -(-nbytes // ALIGN) * ALIGN
        if self.segment is None or self.segment.size < size:
            self._replace(max(size, ALIGN))
        for (_, tensor), (_, offset, nbytes, _, _) in zip(bucket, layout):
            if nbytes:
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=nbytes, offset=offset).copy_(raw)
        return SharedBucket(self.segment.name, tuple(layout), os.getpid())

    def delivered(self) -> None:
        if self.linked:  # every receiver has it mapped now
            self.segment.unlink()
            self.linked = False

    def _replace(self, size: int) -> None:
        self.close()
        if not shared_memory_available(size):
            raise RuntimeError(f"weight sync: /dev/shm has less than {size / (1 << 20):.0f} MB free for a "
                               f"bucket; lower weight_sync_bucket_mb or set weight_sync_transport: object_store")
        self.segment = shared_memory.SharedMemory(create=True, size=size)
        self.linked = True

    def close(self) -> None:
        if self.segment is not None:
            if self.linked:
                self.segment.unlink()
            self.segment.close()
            self.segment, self.linked = None, False


class SharedSegmentReader:
    """A rollout rank's open segment (one at a time), unmapped after a sync's last bucket (`close`)."""

    def __init__(self):
        self.name: Optional[str] = None
        self.segment: Optional[shared_memory.SharedMemory] = None

    def read(self, bucket: SharedBucket, copy: bool = True) -> List[Tuple[str, torch.Tensor]]:
        """The bucket's tensors. `copy=True` copies them out: a loader that keeps a tensor past the
        call (vLLM's layerwise reload buffers a layer's tensors until the layer is complete) would
        otherwise see the next bucket's bytes. Loaders that copy at once take views (`copy=False`):
        no transient copy of the bucket, which holds a whole embedding at 0.5B (0.5 GB)."""
        if bucket.segment != self.name:
            self._open(bucket.segment, owned_here=bucket.writer_pid == os.getpid())
        out = []
        for name, offset, nbytes, shape, dtype_name in bucket.layout:
            if not nbytes:
                raw = torch.empty(0, dtype=torch.uint8)
            else:
                raw = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=nbytes, offset=offset)
                raw = raw.clone() if copy else raw
            out.append((name, raw.view(getattr(torch, dtype_name)).view(shape)))
        return out

    def close(self) -> None:
        if self.segment is not None:
            try:
                self.segment.close()
            except BufferError:  # a view handed out earlier is still referenced: unmapped once it goes
                pass
        self.segment, self.name = None, None

    def _open(self, name: str, owned_here: bool) -> None:
        self.close()
        self.segment = shared_memory.SharedMemory(name=name)
        if not owned_here:
            # Python < 3.13 registers an opened segment for removal at this process's exit; the
            # writer owns it (and unlinks its name once every receiver has it mapped).
            resource_tracker.unregister(self.segment._name, "shared_memory")  # noqa: SLF001
        self.name = name
