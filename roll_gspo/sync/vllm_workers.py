"""How weight buckets reach every vLLM worker of a rollout engine (tensor-parallel or not).

Weight path (the engine's RPC pickles tensors into nested lists, so no tensor goes through it):
each vLLM worker takes the bucket itself and loads its own shard through the model's weight
loaders (`WorkerBucketLoading`, mixed into `WeightUpdateExtension`):

* shared memory (`weight_sync_transport: auto`, rollout rank on the trainer's node): only the
  segment's name and layout (`SharedBucket`) travel through `collective_rpc`; every worker maps
  the trainer's segment and copies its tensors out;
* object store: the rollout actor copies the bucket into a shared-memory segment of its own and
  passes that on the same way;
* collective (`weight_sync_transport: collective`): every worker is a member of the weight-sync
  group (`roll_gspo.sync.collective`) and receives the broadcast itself; only the layout travels
  through `collective_rpc`.
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
            shared = self.segment.write(receive_bucket(payload, reader))
            self.llm.collective_rpc("roll_gspo_load_shared_bucket", args=(shared,))
            self.segment.delivered()

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                          backend: str) -> None:
        self.llm.collective_rpc("roll_gspo_join_weight_group",
                                args=(host, port, first_rank, world_size, timeout_s, backend))


class WorkerBucketLoading:
    """Methods every vLLM worker gets (through `WeightUpdateExtension`): take a bucket itself and
    load this worker's shard of it with `roll_gspo_load_weights`."""

    def roll_gspo_load_shared_bucket(self, bucket) -> None:
        from roll_gspo.sync.broadcast import SharedSegmentReader

        if getattr(self, "_roll_gspo_shared_reader", None) is None:
            self._roll_gspo_shared_reader = SharedSegmentReader()
        self.roll_gspo_load_weights(self._roll_gspo_shared_reader.read(bucket))

    def roll_gspo_join_weight_group(self, host: str, port: int, first_rank: int, world_size: int,
                                    timeout_s: float, backend: str) -> None:
        from roll_gspo.sync.collective import CollectiveReceiver

        # This worker's rank in the engine (its TP rank) places it after the engine's first rank.
        self._roll_gspo_collective = CollectiveReceiver()
        self._roll_gspo_collective.join(host, port, first_rank + int(self.rank), world_size, timeout_s, backend)

    def roll_gspo_receive_collective_bucket(self, meta) -> None:
        self.roll_gspo_load_weights(self._roll_gspo_collective.receive(meta))
