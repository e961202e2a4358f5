"""The Ray layer: dispatch order, failing fast when one rank raises while its peers wait, and the
shared-memory transport of weight sync."""
import os
import time

import pytest
import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster, RankWorker
from roll_gspo.utils.imports import DEEPSPEED_WITHOUT_MLFLOW, TRANSFORMERS_WITHOUT, VLLM_WITHOUT_SCIPY_SIGNAL


class EchoWorker(RankWorker):
    def shard(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * 10}, {"rank": [self.rank] * len(batch)})

    def lighter_import_targets(self) -> list:
        import sys

        return sorted(getattr(f, "target", "") for f in sys.meta_path if hasattr(f, "target"))

    def wait_or_fail(self) -> str:
        if self.rank == 1:
            raise FloatingPointError("rank 1 failed on purpose")
        time.sleep(120)  # like a peer blocked in a collective for the failed rank
        return "late"


def test_dispatch_splits_and_reassembles_in_order(ray_session):
    cluster = Cluster("echo", EchoWorker, world_size=2, num_cpus=0.1, num_gpus=0)
    try:
        out = cluster.dispatch("shard", Batch({"x": torch.arange(5)}))
        assert out["x"].tolist() == [0, 10, 20, 30, 40]
        assert out["rank"] == [0, 0, 1, 1, 1]
        # Each rank imports DeepSpeed without mlflow, transformers without scikit-learn and scipy, vLLM
        # without scipy.signal (tests/test_imports.py: what those hooks do).
        targets = sorted([DEEPSPEED_WITHOUT_MLFLOW[0], *TRANSFORMERS_WITHOUT, VLLM_WITHOUT_SCIPY_SIGNAL[0]])
        assert cluster.execute_all("lighter_import_targets") == [targets, targets]
    finally:
        cluster.shutdown()


def test_a_failing_rank_stops_the_role_instead_of_hanging(ray_session):
    cluster = Cluster("failing", EchoWorker, world_size=2, num_cpus=0.1, num_gpus=0)
    start = time.time()
    with pytest.raises(Exception, match="rank 1 failed on purpose") as error:
        cluster.execute_all("wait_or_fail")
    assert time.time() - start < 60
    assert cluster.workers == []
    # What the command line prints of it: one line naming the rank (no log folder here: no trace file).
    from roll_gspo.distributed.cluster import describe_worker_error

    assert describe_worker_error(error.value) == ("role failing rank 1: FloatingPointError: rank 1 failed on purpose "
                                                  "(raised in EchoWorker.wait_or_fail)")


def test_shared_memory_views_and_a_closed_sync_leave_no_mapping():
    """`copy=False` hands out views of the segment (no copy of the bucket: loaders that copy at once
    use them); once the sync's last bucket is loaded, writer and reader close it and no process
    keeps the memory mapped."""
    from roll_gspo.sync.broadcast import SharedSegmentReader, SharedSegmentWriter

    writer, reader = SharedSegmentWriter(), SharedSegmentReader()
    shared = writer.write([("w", torch.zeros(64, 64))])
    (_, view), = reader.read(shared, copy=False)
    (_, copied), = reader.read(shared, copy=True)
    writer.write([("w", torch.ones(64, 64))])  # the next bucket, written into the same segment
    assert torch.equal(view, torch.ones(64, 64)) and torch.equal(copied, torch.zeros(64, 64))
    writer.delivered()
    del view
    writer.close()
    reader.close()
    with open("/proc/self/maps") as maps:
        assert shared.segment.lstrip("/") not in maps.read()


def test_shared_memory_weight_buckets_round_trip_and_leave_nothing_behind():
    """Writer -> reader through one reused segment: every dtype and shape comes back bit-exact,
    a bigger bucket gets a new segment, and once delivered no name is left in /dev/shm."""
    from roll_gspo.sync.broadcast import SharedBucket, SharedSegmentReader, SharedSegmentWriter, receive_bucket

    writer, reader = SharedSegmentWriter(), SharedSegmentReader()
    bucket = [("embed.weight", torch.randn(7, 5)), ("norm.weight", torch.randn(5).to(torch.bfloat16)),
              ("scalar", torch.tensor(3.0)), ("empty", torch.zeros(0, 4)), ("ids", torch.arange(9).view(3, 3))]
    shared = writer.write(bucket)
    assert isinstance(shared, SharedBucket) and all(offset % 64 == 0 for _, offset, *_ in shared.layout)
    first_name = shared.segment
    for (name, sent), (got_name, got) in zip(bucket, receive_bucket(shared, reader)):
        assert got_name == name and got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
    writer.delivered()
    assert not os.path.exists(f"/dev/shm/{first_name}")  # unlinked once the reader has it mapped

    again = [("embed.weight", torch.ones(7, 5))]  # same segment, new contents
    shared = writer.write(again)
    assert shared.segment == first_name and torch.equal(reader.read(shared)[0][1], torch.ones(7, 5))
    bigger = [("big", torch.randn(1000, 100))]  # outgrows the segment: a new one
    shared = writer.write(bigger)
    assert shared.segment != first_name and torch.equal(reader.read(shared)[0][1], bigger[0][1])
    writer.delivered()
    writer.close()
    assert not os.path.exists(f"/dev/shm/{shared.segment}")
    # The object-store form of the same bucket loads to the same tensors.
    from roll_gspo.sync.broadcast import to_wire

    wire = [(name, *to_wire(tensor)) for name, tensor in bucket]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket, receive_bucket(wire, reader)))
