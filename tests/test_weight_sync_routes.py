"""Weight-sync routes: which way the trained weights take to each rollout worker.

NCCL refuses two members of one group on one GPU ("Duplicate GPU detected"), so a colocated GPU
run must hand its weights to the rollout worker on the trainer's GPU by CUDA IPC. The decision is
one pure function (roll_gspo.placement.weight_routes), taken by the run from the real devices and
printed by `--dry-run` from the planned ones; both are checked here without a GPU.
"""
import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch

from roll_gspo.placement.weight_routes import (CUDA_IPC, GLOO, NCCL, NO_SHM_ROOM, OBJECT_STORE, SHARED_MEMORY,
                                               DevicePlace, WeightRouteError, route_lines, weight_routes)

REPO = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = REPO / "tests" / "data" / "model_configs"


def gpu(node, index):
    return DevicePlace(node, index, f"node {node} GPU {index}")


def cpu(node):
    return DevicePlace(node, None, "CPU")


def kinds(routes):
    return [[r.kind for r in rank] for rank in routes]


def ranks(*workers_per_rank):
    return [(f"actor_infer rank {i}", list(places)) for i, places in enumerate(workers_per_rank)]


# -- the decision ---------------------------------------------------------------------------------
def test_colocated_on_one_gpu_takes_cuda_ipc_never_nccl():
    routes = weight_routes(gpu(0, 0), ranks([gpu(0, 0)]), "auto")
    assert kinds(routes) == [[CUDA_IPC]]
    assert route_lines(routes) == ["actor_infer rank 0 <- CUDA IPC (same GPU as actor_train rank 0)"]


def test_disjoint_gpus_join_one_nccl_group():
    routes = weight_routes(gpu(0, 0), ranks([gpu(0, 4), gpu(0, 5)], [gpu(0, 6), gpu(0, 7)]), "auto")
    assert kinds(routes) == [[NCCL, NCCL], [NCCL, NCCL]]
    assert route_lines(routes) == [
        "actor_infer rank 0 (2 TP workers) <- NCCL collective (another GPU than actor_train rank 0)",
        "actor_infer rank 1 (2 TP workers) <- NCCL collective (another GPU than actor_train rank 0)"]


def test_mixed_receivers_only_the_other_gpus_join_the_group():
    # rank 0 on the trainer's GPU, rank 1 elsewhere, rank 2 a TP pair straddling both.
    routes = weight_routes(gpu(0, 0), ranks([gpu(0, 0)], [gpu(0, 1)], [gpu(0, 0), gpu(0, 2)]), "auto")
    assert kinds(routes) == [[CUDA_IPC], [NCCL], [CUDA_IPC, NCCL]]
    assert route_lines(routes)[2:] == [
        "actor_infer rank 2 TP worker 0 <- CUDA IPC (same GPU as actor_train rank 0)",
        "actor_infer rank 2 TP worker 1 <- NCCL collective (another GPU than actor_train rank 0)"]


def test_two_receivers_on_one_other_gpu_never_both_in_the_group():
    """Two fractional rollout ranks packed on GPU 1: the group holds one process per GPU."""
    routes = weight_routes(gpu(0, 0), ranks([gpu(0, 1)], [gpu(0, 1)]), "auto")
    assert kinds(routes) == [[NCCL], [SHARED_MEMORY]]
    assert "in the NCCL group already, by actor_infer rank 0" in routes[1][0].why
    with pytest.raises(WeightRouteError, match="actor_infer rank 1 shares node 0 GPU 1 with actor_infer rank 0"):
        weight_routes(gpu(0, 0), ranks([gpu(0, 1)], [gpu(0, 1)]), "collective")


def test_multi_node_the_same_gpu_index_elsewhere_is_another_gpu():
    routes = weight_routes(gpu(0, 0), ranks([gpu(1, 0)], [cpu(1)], [cpu(0)]), "auto")
    assert kinds(routes) == [[NCCL], [OBJECT_STORE], [SHARED_MEMORY]]
    assert routes[0][0].why == "a GPU on another node than actor_train rank 0"
    assert routes[1][0].why == "another node than actor_train rank 0"


def test_cpu_runs_keep_shared_memory_and_object_store():
    receivers = ranks([cpu("a"), cpu("a")], [cpu("b")])
    assert kinds(weight_routes(cpu("a"), receivers, "auto")) == [[SHARED_MEMORY] * 2, [OBJECT_STORE]]
    no_room = weight_routes(cpu("a"), receivers, "auto", shared_memory=False)
    assert kinds(no_room) == [[OBJECT_STORE] * 2, [OBJECT_STORE]] and NO_SHM_ROOM in no_room[0][0].why
    assert kinds(weight_routes(cpu("a"), receivers, "object_store")) == [[OBJECT_STORE] * 2, [OBJECT_STORE]]
    assert kinds(weight_routes(cpu("a"), receivers, "collective")) == [[GLOO] * 2, [GLOO]]
    # A GPU receiver of a CPU sender: through host memory too (the loader copies to its GPU).
    assert kinds(weight_routes(cpu("a"), ranks([gpu("a", 0)]), "auto")) == [[SHARED_MEMORY]]
    # object_store is obeyed on GPUs as well.
    assert kinds(weight_routes(gpu(0, 0), ranks([gpu(0, 0)]), "object_store")) == [[OBJECT_STORE]]


def test_forced_collective_is_refused_where_nccl_cannot_form_the_group():
    with pytest.raises(WeightRouteError, match=r"actor_infer rank 0 shares node 0 GPU 0 with actor_train rank 0.*"
                                               r"Duplicate GPU detected.*use auto \(CUDA IPC for it\)"):
        weight_routes(gpu(0, 0), ranks([gpu(0, 0)]), "collective")
    with pytest.raises(WeightRouteError, match="actor_infer rank 0 has no GPU"):
        weight_routes(gpu(0, 0), ranks([cpu(0)]), "collective")
    assert kinds(weight_routes(gpu(0, 0), ranks([gpu(0, 1), gpu(0, 2)]), "collective")) == [[NCCL, NCCL]]


def test_a_rank_takes_its_buckets_one_way_host_or_device():
    """A TP rank with a worker pushed to the host route (its GPU in the group already) sends all
    its workers that way: one payload reaches every worker of a rank."""
    routes = weight_routes(gpu(0, 0), ranks([gpu(0, 1)], [gpu(0, 0), gpu(0, 1)]), "auto")
    assert kinds(routes) == [[NCCL], [SHARED_MEMORY, SHARED_MEMORY]]


def test_group_members_skip_the_workers_on_the_senders_gpu():
    from roll_gspo.sync.collective import group_members

    assert group_members([[CUDA_IPC], [NCCL, NCCL], [CUDA_IPC, NCCL]]) == [[None], [1, 2], [None, 3]]
    assert group_members([[GLOO], [GLOO, GLOO]]) == [[1], [2, 3]]


# -- the receiving end of CUDA IPC (torch's handle, its device index replaced) ----------------------
def test_cuda_ipc_receiver_maps_the_senders_gpu_by_its_own_index(monkeypatch):
    """The handle names the sender's device index; the receiver rebuilds it at its own index of
    the same GPU (found by UUID), copies it out, and needs no group."""
    from roll_gspo.sync import collective, cuda_ipc

    bucket = [("w", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    meta = collective.bucket_layout(bucket)
    flat = collective.pack_bucket(bucket, meta, "cpu")
    seen = {}

    def rebuild(*args):
        seen["device"] = args[cuda_ipc.DEVICE_ARG]
        return flat

    handle = (rebuild, tuple(range(cuda_ipc.DEVICE_ARG)) + (0, "storage handle"))  # sender's index 0
    monkeypatch.setattr(cuda_ipc, "local_index", lambda uuid: {"GPU-same": 3}[uuid])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(collective, "gpu_identity", lambda: "GPU-same")
    shared = collective.CollectiveBucket(meta.nbytes, meta.layout, cuda_ipc.SharedCudaBuffer("GPU-same", handle))
    got = collective.CollectiveReceiver().receive(shared)
    assert seen["device"] == 3
    assert [name for name, _ in got] == ["w", "b"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, bucket))
    monkeypatch.setattr(collective, "gpu_identity", lambda: "GPU-other")  # not on the sender's GPU, no group
    with pytest.raises(collective.WeightSyncError, match="before this rollout worker joined"):
        collective.CollectiveReceiver().receive(shared)


# -- config check and --dry-run -----------------------------------------------------------------
def dry_run(capsys, tmp_path, recipe: str, model: str, *overrides: str):
    from roll_gspo.cli import main

    (tmp_path / "config.json").write_text((MODEL_CONFIGS / f"{model}.json").read_text())
    code = main(["--config", str(REPO / "configs" / "gpu" / recipe), "--dry-run", f"pretrain={tmp_path}", *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_of_the_colocated_one_gpu_recipe_prints_cuda_ipc(tmp_path, capsys):
    code, out, err = dry_run(capsys, tmp_path, "qwen2.5-0.5b_1gpu.yaml", "Qwen2.5-0.5B", "--nodes", "1",
                             "--gpus-per-node", "1")
    assert code == 0, err
    assert "weight sync (weight_sync_transport: auto) from actor_train rank 0 (node 0 GPU 0):" in out
    assert "  actor_infer rank 0 <- CUDA IPC (same GPU as actor_train rank 0)" in out
    assert "NCCL" not in out


def test_dry_run_of_the_8_gpu_recipe_prints_nccl_for_every_tp_worker(tmp_path, capsys):
    code, out, err = dry_run(capsys, tmp_path, "qwen2.5-7b_8gpu.yaml", "Qwen2.5-7B", "--nodes", "1")
    assert code == 0, err
    for rank in (0, 1):
        assert (f"  actor_infer rank {rank} (2 TP workers) <- NCCL collective (another GPU than actor_train "
                f"rank 0)") in out
    assert "CUDA IPC" not in out


def test_forced_collective_on_a_shared_gpu_is_a_config_error_before_workers_start(tmp_path, capsys):
    code, out, err = dry_run(capsys, tmp_path, "qwen2.5-0.5b_1gpu.yaml", "Qwen2.5-0.5B", "--nodes", "1",
                             "--gpus-per-node", "1", "weight_sync_transport=collective")  # the GPU run's plan
    assert code == 1
    assert "invalid configuration" in err and "Duplicate GPU detected" in err and "use auto" in err
    assert "placement plan" not in out


def test_dry_run_of_a_cpu_run_prints_the_host_route(capsys):
    from roll_gspo.cli import main

    assert main(["--config", "example_gspo.yaml", "--dry-run", "--nodes", "1", "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "weight sync (weight_sync_transport: auto) from actor_train rank 0 (on CPU):" in out
    assert "  actor_infer rank 0 <- shared memory (same node as actor_train rank 0)" in out


# -- the run's wiring: WeightSender asks each rollout rank where its workers sit --------------------
class PlacedSink:
    """A rollout rank that reports the GPUs it is given (nothing is sent to it here)."""

    def __init__(self, gpus):
        self.gpus = gpus

    def node_id(self):
        import ray

        return ray.get_runtime_context().get_node_id()

    def weight_gpus(self):
        return self.gpus


@pytest.mark.e2e
def test_weight_sender_routes_each_rank_from_the_devices_it_reports(ray_session, monkeypatch):
    from roll_gspo.sync import broadcast, collective

    made = {}

    class DeviceRoutes:  # stands in for the group and IPC set-up, which need CUDA
        def __init__(self, receivers, routes, timeout_s):
            made.update(receivers=receivers, routes=routes)

    monkeypatch.setattr(broadcast, "gpu_identity", lambda: "GPU-A")  # the trainer "is on" GPU-A
    monkeypatch.setattr(collective, "CollectiveSender", DeviceRoutes)
    sinks = [ray_session.remote(num_cpus=0.01)(PlacedSink).remote(gpus)
             for gpus in (["GPU-A"], ["GPU-B", "GPU-A"], [None])]
    sender = broadcast.WeightSender(sinks, "auto", 1 << 20, timeout_s=60)
    assert made["receivers"] == sinks[:2]
    assert made["routes"] == [[CUDA_IPC], [NCCL, CUDA_IPC]]
    assert sender.by_shared_memory == [sinks[2]] and sender.by_object_store == []
    for sink in sinks:
        ray_session.kill(sink)


class LoadingSink:
    """A CPU rollout rank that takes `load_s` to load a bucket and answers health probes meanwhile
    (its `health` runs on a thread of its own, as ActorInferWorker's does)."""

    def __init__(self, load_s):
        self.load_s = load_s

    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def weight_receivers(self):
        return 1

    def pid(self):
        return os.getpid()

    def load_weight_bucket(self, bucket, first, last, version=None):
        time.sleep(self.load_s)

    @ray.method(concurrency_group="health")
    def health(self):
        return 0, 0


@pytest.mark.e2e
def test_a_rollout_rank_stopped_mid_load_fails_the_sync_at_the_hang_deadline_naming_it(ray_session):
    """Issue 57's HANG cell (actor_infer:weight-sync:stop): a rollout rank SIGSTOPped while it loads
    a bucket answers no probe; the sender names it (`unresponsive`) after fault_tolerance.hang_timeout_s,
    not weight_sync_timeout_s, while a slow rank that answers is waited for."""
    from roll_gspo.sync import broadcast
    from roll_gspo.sync.collective import WeightSyncError

    remote = ray_session.remote(num_cpus=0.01, concurrency_groups={"health": 1})(LoadingSink)
    slow, stopped = remote.remote(2.5), remote.remote(0.1)
    sender = broadcast.WeightSender([slow, stopped], "object_store", 1 << 20, timeout_s=600, hang_timeout_s=1.0)
    bucket = [("w", torch.ones(4))]
    pid = ray_session.get(stopped.pid.remote())
    try:
        sender.send(bucket, first=True, last=False)  # both still load after the bucket time: slow, not hung
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"actor_infer rank 1 is unresponsive .*hang_timeout_s = 1 s") as err:
            sender.send(bucket, first=False, last=True)
        assert err.value.unresponsive == [1]
        assert time.monotonic() - start < 10  # the probe deadline, not weight_sync_timeout_s (600 s)
        fields = broadcast.lost_fields(err.value)
        assert fields[broadcast.UNRESPONSIVE_RECEIVERS] == [1]
        assert broadcast.receiver_lost(err.value)
    finally:
        os.kill(pid, signal.SIGKILL)
        ray_session.kill(slow)
