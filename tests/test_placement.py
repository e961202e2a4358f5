"""device_mapping: parsing (never eval), the placement plan, the config's derived world_size, and
placement on a simulated two-node Ray cluster (`ray start --head` + `ray start --address`, GPUs
declared with --num-gpus on a CPU machine)."""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from roll_gspo.distributed.cluster import free_port
from roll_gspo.placement.device_mapping import (PlacementError, check_plan_against_nodes,
    parse_device_mapping, plan_placement)
from tests.conftest import REPO_ROOT
from tests.ray_nodes import stop_ray_nodes


@pytest.mark.parametrize("value, gpus", [
    ("list(range(0,16))", list(range(16))), ("list(range(8, 16))", list(range(8, 16))),
    ("range(0,8)", list(range(8))), ("range(0, 8, 2)", [0, 2, 4, 6]), ("[0,1,2]", [0, 1, 2]),
    ("0,1", [0, 1]), (" 3 ", [3]), ([4, 5], [4, 5]), (2, [2]), ("list([1, 3])", [1, 3]), (None, None)])
def test_device_mapping_forms_parse(value, gpus):
    assert parse_device_mapping(value) == gpus


@pytest.mark.parametrize("value, message", [
    ("__import__('os').system('echo hacked')", "cannot read"), ("list(range(0,n))", "cannot read"),
    ("[0, 1.5]", "cannot read"), ("0,x", "cannot read"), ("range(0)", "names no GPU"), ([], "names no GPU"),
    ("[0, 0, 1]", "more than once"), ([-1, 0], ">= 0"), ("[-1, 0]", "cannot read"), (True, "expected"), ([0, "1"], "cannot read"),
    ({"a": 1}, "cannot read"), ("sorted(range(4))", "cannot read")])
def test_bad_device_mappings_are_refused_naming_the_key(value, message):
    with pytest.raises(PlacementError, match=message) as err:
        parse_device_mapping(value, "actor_train.device_mapping")
    assert "actor_train.device_mapping" in str(err.value)


def test_overlapping_maps_share_disjoint_split_and_ranks_group_gpus():
    plan = plan_placement({"actor_train": (list(range(8)), 1, 1.0), "actor_infer": (list(range(8)), 2, 0.5),
                           "reference": ([8, 9], 1, 1.0)}, num_gpus_per_node=8)
    train, infer, ref = plan.slots["actor_train"], plan.slots["actor_infer"], plan.slots["reference"]
    assert [s.gpus for s in infer] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # GPU 0 anchors actor_train rank 0 and actor_infer rank 0: each takes half; GPU 1 only train's rank 1.
    assert (train[0].gpu_share, infer[0].gpu_share, train[1].gpu_share) == (0.5, 0.5, 1.0)
    assert [s.node_index for s in ref] == [1, 1] and ref[0].gpu_share == 1.0
    assert plan.node_gpus() == {0: list(range(8)), 1: [8, 9]}
    assert plan.bundle_cpus(0) == 1.5 and plan.bundle_cpus(1) == 1.0
    with pytest.raises(PlacementError, match="rank 0 would span nodes"):
        plan_placement({"actor_infer": ([3, 4], 2, 1.0)}, num_gpus_per_node=4)
    with pytest.raises(PlacementError, match="do not split into ranks"):
        plan_placement({"actor_infer": ([0, 1, 2], 2, 1.0)}, num_gpus_per_node=4)


def test_a_mapping_the_cluster_cannot_hold_names_the_shortfall():
    plan = plan_placement({"actor_train": (list(range(16)), 1, 1.0)}, num_gpus_per_node=8)
    nodes = [{"NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"GPU": 8.0, "CPU": 32.0}},
             {"NodeManagerAddress": "10.0.0.2", "Alive": True, "Resources": {"GPU": 4.0, "CPU": 32.0}}]
    with pytest.raises(PlacementError) as err:
        check_plan_against_nodes(plan, nodes)
    message = str(err.value)
    assert "node index 1 (GPUs [8, 9, 10, 11, 12, 13, 14, 15] of actor_train" in message
    assert "needs one node with 8 GPUs" in message and "10.0.0.2 with 4 GPUs" in message
    assert "short by 4 GPUs" in message and "16 GPUs on 2 node(s)" in message
    nodes[1]["Resources"]["GPU"] = 8.0
    check_plan_against_nodes(plan, nodes)


def test_config_derives_world_size_and_refuses_contradictions(tmp_path):
    from omegaconf import OmegaConf

    from roll_gspo.config import ConfigError, load_config

    def load(**changes):
        path = tmp_path / "c.yaml"
        base = OmegaConf.create({"actor_train": {"data_args": {"file_name": ["builtin:arith/train"]}},
                                 "rollout_batch_size": 8})
        OmegaConf.save(OmegaConf.merge(base, OmegaConf.create(changes)), path)
        return load_config(str(path))

    cfg = load(actor_train={"device_mapping": "list(range(0,4))"}, actor_infer={"device_mapping": "0,1,2,3",
               "num_gpus_per_worker": 2, "strategy_args": {"strategy_config": {"tensor_parallel_size": 2}}})
    assert (cfg.actor_train.world_size, cfg.actor_train.device_mapping) == (4, [0, 1, 2, 3])
    assert (cfg.actor_infer.world_size, cfg.actor_infer.num_gpus_per_worker) == (2, 2.0)
    with pytest.raises(ConfigError, match=r"actor_train.world_size = 3 contradicts device_mapping"):
        load(actor_train={"device_mapping": "range(0,4)", "world_size": 3})
    with pytest.raises(ConfigError, match=r"actor_train.num_gpus_per_worker = 2: deepspeed_train ranks use one GPU"):
        load(actor_train={"device_mapping": "range(0,4)", "num_gpus_per_worker": 2})
    cfg = load(actor_infer={"device_mapping": "range(0,4)", "strategy_args": {"strategy_config": {"tensor_parallel_size": 4}}})
    assert (cfg.actor_infer.world_size, cfg.actor_infer.num_gpus_per_worker) == (1, 4.0)  # ROLL: TP x PP per rank
    with pytest.raises(ConfigError, match=r"actor_infer.num_gpus_per_worker = 1 contradicts the vLLM engine's"):
        load(actor_infer={"device_mapping": "range(0,4)", "num_gpus_per_worker": 1,
                          "strategy_args": {"strategy_config": {"tensor_parallel_size": 2}}})
    with pytest.raises(ConfigError, match=r"reference.device_mapping: cannot read 'eval\(1\)'"):
        load(reference={"device_mapping": "eval(1)"})


# --- a simulated two-node cluster ------------------------------------------------------------------
GPUS_PER_NODE = 4


def _ray_start(args, log_path, env):
    return subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats",
                             *args], env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


_WORKER_PORT_BASE = 11000 + random.randrange(0, 200) * 100


def _node_ports(node_index):
    """Free ports for one node. The worker range lies in 11000-31100: below Linux's ephemeral range, where
    free_port()'s picks fall, and above Ray's default client-server port 10001 (CI once drew 10000-10060)."""
    base = _WORKER_PORT_BASE + node_index * 100
    return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--min-worker-port={base}", f"--max-worker-port={base + 60}"]


class _NodeExited(RuntimeError):
    """A `ray start --block` process ended while its node was starting (it ends when one of its parts dies)."""


def _start_two_nodes(logs, env, temp_dirs):
    """Start a head and a second node; return (address, processes). Ports are picked free but can be
    taken by another process's connection before Ray binds them: then the node exits (_NodeExited)."""
    address = f"127.0.0.1:{free_port()}"
    head = _ray_start(["--head", f"--port={address.rsplit(':', 1)[1]}", "--node-ip-address=127.0.0.1",
                       "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                       "--num-cpus=2", f"--num-gpus={GPUS_PER_NODE}", f"--temp-dir={temp_dirs[0]}", *_node_ports(0)],
                      logs / "head.log", env)
    processes = [head]
    try:
        _wait_for_nodes(address, 1, env, logs / "head.log", processes)
        processes.append(_ray_start([f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                                     f"--num-gpus={GPUS_PER_NODE}", f"--temp-dir={temp_dirs[1]}", *_node_ports(1)],
                                    logs / "node2.log", env))
        _wait_for_nodes(address, 2, env, logs / "node2.log", processes)
    except BaseException:
        stop_ray_nodes(processes, grace_s=10)
        raise
    return address, processes


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """A head and a second node on this machine, each with 4 fake GPUs and 2 CPUs; started once
    (up to three tries, each with fresh ports, when a node exits while starting)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    temp_dirs = []
    try:
        for attempt in range(3):
            logs = tmp_path_factory.mktemp(f"two_nodes_try{attempt}")
            temp_dirs = [tempfile.mkdtemp(prefix="rg_pl", dir="/tmp") for _ in range(2)]
            try:
                address, processes = _start_two_nodes(logs, env, temp_dirs)
                break
            except _NodeExited:
                if attempt == 2:
                    raise
                for folder in temp_dirs:
                    shutil.rmtree(folder, ignore_errors=True)
        try:
            yield {"address": address, "env": env}
        finally:
            stop_ray_nodes(processes, grace_s=10)
    finally:
        for folder in temp_dirs:
            shutil.rmtree(folder, ignore_errors=True)


def _wait_for_nodes(address, count, env, log_path, processes, timeout_s=300):
    deadline = time.time() + timeout_s
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(sum(1 for n in ray.nodes() if n['Alive']))")
    while time.time() < deadline:
        exited = [p for p in processes if p.poll() is not None]
        if exited:
            raise _NodeExited(f"a Ray node exited while starting (rc {exited[0].returncode}):\n" + "\n".join(
                f"{log.name}: {log.read_text()[-3000:]}" for log in sorted(Path(log_path).parent.glob("*.log"))))
        try:
            out = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True,
                                 timeout=max(min(deadline - time.time(), 60), 1))
        except subprocess.TimeoutExpired:  # a loaded machine: the deadline decides
            continue
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise TimeoutError(f"{count} Ray node(s) did not come up:\n" + Path(log_path).read_text()[-3000:])


def _drive(cluster, scenario, *args, timeout_s=300):
    """Run tests/placement_driver.py against the cluster (a driver of its own: this test process
    may already hold a local Ray) and return its JSON answer."""
    out = subprocess.run([sys.executable, "-m", "tests.placement_driver", cluster["address"], scenario, *args],
                         cwd=REPO_ROOT, env={**cluster["env"], **{k: v for k, v in os.environ.items() if k ==
                                                                  "ROLL_GSPO_CACHE"}, "PYTHONPATH": str(REPO_ROOT)},
                         capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_device_mapping_places_ranks_across_two_nodes(two_node_cluster):
    result = _drive(two_node_cluster, "spread")
    nodes = result["nodes"]
    assert len(set(nodes)) == 2
    train = result["actor_train"]
    # GPUs 0-3 are node 0, 4-7 node 1 (num_gpus_per_node 4): ranks follow their GPUs.
    assert len({r["node"] for r in train[:4]}) == 1 and len({r["node"] for r in train[4:]}) == 1
    assert train[0]["node"] != train[4]["node"]
    # actor_infer overlaps GPUs 0-3 (shares them with actor_train), 2 GPUs per rank, both visible.
    infer = result["actor_infer"]
    assert [r["node"] for r in infer] == [train[0]["node"]] * 2
    assert [len(r["cuda_visible_devices"].split(",")) for r in infer] == [2, 2]
    # Disjoint reference on GPUs 6-7: node 1, one GPU each, a distinct device per rank.
    ref = result["reference"]
    assert {r["node"] for r in ref} == {train[4]["node"]}
    assert len({r["cuda_visible_devices"] for r in ref}) == 2
    assert result["placement_groups_left"] == 0


@pytest.mark.e2e
def test_an_impossible_mapping_fails_before_any_worker_starts(two_node_cluster):
    result = _drive(two_node_cluster, "too_big")
    assert "needs one node with 4 GPUs" in result["error"] and "node index 2" in result["error"]
    assert result["placement_groups"] == 0


@pytest.mark.e2e
def test_roles_pinned_to_different_nodes_and_weights_cross_them(two_node_cluster, tiny_model, tmp_path):
    """The YAML a user writes (num_gpus_per_node 4, actor_train.device_mapping [0], actor_infer
    [4]) puts training on one node and rollout on the other: the workers say so themselves, and
    after a step the weights that crossed nodes give rollout log-probs equal to the trainer's."""
    result = _drive(two_node_cluster, "pinned_pipeline", tiny_model, str(tmp_path), timeout_s=600)
    train, infer = set(result["train_nodes"]), set(result["infer_nodes"])
    assert len(train) == len(infer) == 1 and train != infer, result
    assert result["gap_before"] < 1e-4 and result["gap_after"] < 1e-4, result  # fp32, as in test_pipeline_e2e
    assert result["changed"] > 1e-3, result  # the step did change the weights that crossed


@pytest.mark.e2e
def test_dry_run_reads_the_running_cluster(two_node_cluster, tiny_model):
    """`--dry-run --ray-address` plans against the nodes Ray reports (two of 4 declared GPUs)."""
    def dry_run(*overrides):
        return subprocess.run(
            [sys.executable, "run_pipeline.py", "--config", "example_gspo.yaml", "--dry-run", "--ray-address",
             two_node_cluster["address"], f"pretrain={tiny_model}", "num_gpus_per_node=4",
             "actor_train.world_size=1", "actor_infer.strategy_args.strategy_name=hf_infer",  # no vLLM import
             "actor_infer.strategy_args.strategy_config={}", *overrides],
            cwd=REPO_ROOT, env={**two_node_cluster["env"], "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True, text=True, timeout=300)

    # Node indices 0, 1 and 2 (GPUs 0, 4, 8 at 4 per node) on two nodes.
    too_big = dry_run("actor_train.device_mapping=[0]", "actor_infer.device_mapping=[4,8]")
    assert "on 3 node(s): needs 3 nodes; cluster: the Ray cluster at" in too_big.stdout, too_big.stderr[-3000:]
    assert too_big.stdout.count("4 GPUs / 2 CPUs") == 2  # both nodes, as Ray reports them
    assert "node 2 (MISSING: not in the cluster" in too_big.stdout
    assert too_big.returncode == 1 and "actor_infer.device_mapping names GPUs that do not exist: 8" in too_big.stderr
    assert "the cluster is too small: the roles need 3 GPUs on 3 node(s)" in too_big.stderr
