"""How weight buckets reach every vLLM worker of a rollout engine (tensor-parallel or not).

Weight path (the engine's RPC pickles tensors into nested lists, so no tensor goes through it):
each vLLM worker takes the bucket itself and loads its own shard through the model's weight
loaders (`WorkerBucketLoading`, mixed into `WeightUpdateExtension`):

* shared memory (`weight_sync_transport: auto`, rollout rank on the trainer's node): only the
  segment's name and layout (`SharedBucket`) travel through `collective_rpc`; every worker maps
  the trainer's segment and copies its tensors out;
* object store: the rollout actor copies the bucket into a shared-memory segment of its own and
  passes that on the same way;
* on devices (CUDA IPC, NCCL or gloo; `roll_gspo.sync.collective`): a worker on the trainer's
  GPU maps the trainer's buffer by CUDA IPC, every other is a member of the weight-sync group and
  receives the broadcast itself; only the layout (and the IPC handle) travel through
  `collective_rpc`. Each worker reports its GPU (`roll_gspo_gpu_identity`) for the route decision.
"""
from __future__ import annotations


class WorkerBucketRelay:
    """The rollout actor's side: hands a bucket to every vLLM worker without tensors in the RPC
    (`collective_rpc` carries only a segment name or a layout)."""

    def __init__(self, llm):
        self.llm = llm
        self.segment = None  # a SharedSegmentWriter, for buckets that came by object store

    def load(self, payload, reader) -> None:
        from roll_gspo.sync.broadcast import SharedBucket, SharedSegmentWriter, receive_bucket
        from roll_gspo.sync.collective import CollectiveBucket

        if isinstance(payload, CollectiveBucket):
            self.llm.collective_rpc("roll_gspo_receive_collective_bucket", args=(payload,))
        elif isinstance(payload, SharedBucket):
            self.llm.collective_rpc("roll_gspo_load_shared_bucket", args=(payload,))
        else:
            if self.segment is None:
                self.segment = SharedSegmentWriter()
            shared = self.segment.write(receive_bucket(payload, reader, copy=False))  # copied into ours here
            self.llm.collective_rpc("roll_gspo_load_shared_bucket", args=(shared,))
            self.segment.delivered()

    def close(self) -> None:
        """After a sync: its segment goes (the next sync makes one)."""
        if self.segment is not None:
            self.segment.close()

    def gpu_identities(self) -> list:
        """Each vLLM worker's GPU UUID (None on CPU), in worker (TP rank) order."""
        return self.llm.collective_rpc("roll_gspo_gpu_identity")

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                          backend: str, members=None) -> None:
        self.llm.collective_rpc("roll_gspo_join_weight_group",
                                args=(host, port, first_rank, world_size, timeout_s, backend, members))


class WorkerBucketLoading:
    """Methods every vLLM worker gets (through `WeightUpdateExtension`): take a bucket itself and
    load this worker's shard of it with `roll_gspo_load_weights`."""

    def roll_gspo_load_shared_bucket(self, bucket) -> None:
        from roll_gspo.sync.broadcast import SharedSegmentReader

        if getattr(self, "_roll_gspo_shared_reader", None) is None:
            self._roll_gspo_shared_reader = SharedSegmentReader()
        direct = getattr(self, "_roll_gspo_packed", None) is not None  # loaders copy at once: views do
        self.roll_gspo_load_weights(self._roll_gspo_shared_reader.read(bucket, copy=not direct))

    def roll_gspo_close_shared_bucket(self) -> None:
        """After a sync's last bucket: unmap the trainer's segment (it frees it then)."""
        if getattr(self, "_roll_gspo_shared_reader", None) is not None:
            self._roll_gspo_shared_reader.close()

    def roll_gspo_gpu_identity(self):
        from roll_gspo.sync.cuda_ipc import gpu_identity

        return gpu_identity()

    def roll_gspo_join_weight_group(self, host: str, port: int, first_rank: int, world_size: int,
                                    timeout_s: float, backend: str, members=None) -> None:
        # This worker's rank in the engine (its TP rank) places it after the engine's first rank,
        # unless `members` gives each worker's group rank (None: it takes buckets by CUDA IPC).
        rank = first_rank + int(self.rank) if members is None else members[int(self.rank)]
        if rank is not None:
            self._roll_gspo_collective_receiver().join(host, port, rank, world_size, timeout_s, backend)

    def roll_gspo_receive_collective_bucket(self, meta) -> None:
        self.roll_gspo_load_weights(self._roll_gspo_collective_receiver().receive(meta))

    def _roll_gspo_collective_receiver(self):
        """This worker's end of the device routes (made on first use: a worker on the trainer's
        GPU never joins a group)."""
        from roll_gspo.sync.collective import CollectiveReceiver

        if getattr(self, "_roll_gspo_collective", None) is None:
            self._roll_gspo_collective = CollectiveReceiver()
        return self._roll_gspo_collective
