"""A Ray driver for tests/test_placement.py: `python -m tests.placement_driver ADDRESS SCENARIO`
places roles by device_mapping on the cluster at ADDRESS and prints one JSON line."""
import json
import os
import sys

import ray

from roll_gspo.distributed.cluster import Cluster, RankWorker
from roll_gspo.distributed.placement import GpuPlacement, PlacementError, plan_placement


class WhereWorker(RankWorker):
    def where(self) -> dict:
        return {"node": ray.get_runtime_context().get_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def spread() -> dict:
    roles = {"actor_train": (list(range(8)), 1, 0.1), "actor_infer": ([0, 1, 2, 3], 2, 0.1),
             "reference": ([6, 7], 1, 0.1)}
    placement = GpuPlacement(plan_placement(roles, num_gpus_per_node=4)).reserve()
    result = {"nodes": sorted(placement.node_ids.values())}
    clusters = []
    try:
        for name, (gpus, per_worker, cpus) in roles.items():
            cluster = Cluster(name, WhereWorker, len(gpus) // per_worker, cpus, 0,
                              rank_options=placement.rank_options(name))
            clusters.append(cluster)
            result[name] = cluster.execute_all("where")
    finally:
        for cluster in clusters:
            cluster.shutdown()
        placement.shutdown()
    result["placement_groups_left"] = sum(1 for pg in ray.util.placement_group_table().values()
                                          if pg["state"] == "CREATED")
    return result


def too_big() -> dict:
    # 12 GPUs at 4 per node: node index 2 does not exist on a two-node cluster.
    try:
        GpuPlacement(plan_placement({"actor_train": (list(range(12)), 1, 0.1)}, num_gpus_per_node=4)).reserve()
    except PlacementError as exc:
        # The plan was refused before any placement group was made.
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        return {"error": str(exc), "placement_groups": len(groups)}
    return {"error": "", "placement_groups": -1}


if __name__ == "__main__":
    ray.init(address=sys.argv[1], log_to_driver=False)
    print(json.dumps({"spread": spread, "too_big": too_big}[sys.argv[2]]()))
