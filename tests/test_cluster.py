"""The Ray layer: dispatch order, and failing fast when one rank raises while its peers wait."""
import time

import pytest
import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster, RankWorker


class EchoWorker(RankWorker):
    def shard(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * 10}, {"rank": [self.rank] * len(batch)})

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
    finally:
        cluster.shutdown()


def test_a_failing_rank_stops_the_role_instead_of_hanging(ray_session):
    cluster = Cluster("failing", EchoWorker, world_size=2, num_cpus=0.1, num_gpus=0)
    start = time.time()
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        cluster.execute_all("wait_or_fail")
    assert time.time() - start < 60
    assert cluster.workers == []
