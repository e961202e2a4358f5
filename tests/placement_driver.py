"""A Ray driver for tests/test_placement.py: `python -m tests.placement_driver ADDRESS SCENARIO [ARGS]`
places roles by device_mapping on the cluster at ADDRESS and prints one JSON line."""
import json
import os
import sys

import ray

from roll_gspo.distributed.cluster import Cluster, RankWorker
from roll_gspo.placement.device_mapping import GpuPlacement, PlacementError, plan_placement


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


def pinned_pipeline(model: str, out_dir: str) -> dict:
    """The RLVR pipeline with actor_train on GPU 0 (node index 0) and actor_infer on GPU 4 (node
    index 1, num_gpus_per_node 4), as a user writes it: one step, then the rollout engine's
    log-probs of fixed sequences against the trainer's. Node ids come from the workers."""
    from pathlib import Path

    import torch

    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop
    from roll_gspo.distributed.batch import Batch
    from tests.test_pipeline_e2e import write_config

    cfg = write_config(Path(out_dir), model, max_steps=1, num_gpus_per_node=4, rollout_batch_size=2,
                       actor_train={"device_mapping": [0], "world_size": 1, "num_cpus_per_worker": 0.5},
                       actor_infer={"device_mapping": [4], "num_cpus_per_worker": 0.5})
    pipeline = TrainerLoop(cfg, make_prompt_group_source)
    try:
        fixed = Batch(meta={"prompt_ids": [[20, 21, 15, 22], [23, 24, 15]], "response_ids": [[20, 21, 1], [22, 1]]})
        pipeline._add_sequence_tensors(fixed)

        def log_probs():
            rollout = [torch.tensor(r) for r in ray.get(pipeline.actor_infer.workers[0].score.remote(fixed))]
            trainer = pipeline.actor_train.dispatch("compute_log_probs", pipeline._view(fixed))["old_log_probs"]
            return rollout, max(float((v - trainer[i, :len(v)]).abs().max()) for i, v in enumerate(rollout))

        before, gap_before = log_probs()
        pipeline.step(1)  # generate on node 1, train on node 0, weights cross to node 1
        after, gap_after = log_probs()
        return {"train_nodes": pipeline.actor_train.execute_all("node_id"),
                "infer_nodes": pipeline.actor_infer.execute_all("node_id"),
                "reward_nodes": [n for c in pipeline.rewards.values() for n in c.execute_all("node_id")],
                "gap_before": gap_before, "gap_after": gap_after,
                "changed": max(float((a - b).abs().max()) for a, b in zip(after, before))}
    finally:
        pipeline.shutdown()


if __name__ == "__main__":
    ray.init(address=sys.argv[1], log_to_driver=False)
    scenarios = {"spread": spread, "too_big": too_big, "pinned_pipeline": pinned_pipeline}
    print(json.dumps(scenarios[sys.argv[2]](*sys.argv[3:])))
