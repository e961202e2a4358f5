"""The `--dry-run` placement plan (roll_gspo.placement.cluster_plan): where each rank goes on a described
cluster and what each GPU holds. Pure functions over loaded configs: no Ray, no model."""
import json
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from roll_gspo.config import ConfigError, load_config
from roll_gspo.placement.cluster_plan import ClusterSpec, plan_cluster
from roll_gspo.placement.device_mapping import assign_node_indices
from roll_gspo.placement.memory import GIB, ModelShape

REPO = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = Path(__file__).resolve().parent / "data" / "model_configs"
QWEN25_7B = ModelShape.from_hf_config(json.loads((MODEL_CONFIGS / "Qwen2.5-7B.json").read_text()))
QWEN3_30B = ModelShape.from_hf_config(json.loads((MODEL_CONFIGS / "Qwen3-30B-A3B.json").read_text()))
CHECKED_WITH = re.compile(r"^# Checked with: run_pipeline\.py --config (\S+) (--dry-run[^\n]*?) "
                          r"pretrain=<folder with (\S+)'s config\.json>$", re.M)


@pytest.mark.parametrize("recipe", sorted((REPO / "configs" / "gpu").glob("*.yaml")), ids=lambda p: p.name)
def test_every_gpu_recipe_passes_dry_run_against_the_cluster_it_names(recipe, tmp_path, capsys):
    """Each configs/gpu/*.yaml states its cluster and the exact `--dry-run` line it was checked
    with; that line passes here against a folder holding only the model's config.json."""
    from roll_gspo.cli import main

    text = recipe.read_text()
    assert "# Planned for:" in text, f"{recipe.name}: no '# Planned for: <cluster>' header line"
    found = CHECKED_WITH.search(text)
    assert found, (f"{recipe.name}: no header line '# Checked with: run_pipeline.py --config {recipe.relative_to(REPO)} "
                   f"--dry-run --nodes N --gpus-per-node G --device-memory-gb M pretrain=<folder with MODEL's "
                   f"config.json>' (MODEL: a file in tests/data/model_configs)")
    config, flags, model = found.groups()
    assert config == f"configs/gpu/{recipe.name}"
    assert "--nodes" in flags and "--device-memory-gb" in flags
    (tmp_path / "config.json").write_text((MODEL_CONFIGS / f"{model}.json").read_text())
    assert main(["--config", str(recipe), *shlex.split(flags), f"pretrain={tmp_path}"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "memory: fits" in out and "MISSING" not in out
    nodes = int(flags.split("--nodes")[1].split()[0])
    assert (f"needs {nodes} nodes" in out) == (nodes > 1)


def load(tmp_path, **changes):
    base = {"rollout_batch_size": 64, "num_return_sequences_in_group": 8, "prompt_length": 1024,
            "response_length": 2048, "num_gpus_per_node": 8,
            "actor_train": {"model_args": {"dtype": "bf16", "gradient_checkpointing": True},
                            "training_args": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8},
                            "data_args": {"file_name": ["builtin:arith/train"]},
                            "strategy_args": {"strategy_config": {"zero_optimization": {"stage": 3}}},
                            "device_mapping": "list(range(0,4))"},
            "actor_infer": {"model_args": {"dtype": "bf16"}, "device_mapping": "list(range(4,8))",
                            "strategy_args": {"strategy_config": {"tensor_parallel_size": 2,
                                                                  "gpu_memory_utilization": 0.85,
                                                                  "max_num_seqs": 256}}}}
    path = tmp_path / "c.yaml"
    OmegaConf.save(OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(changes)), path)
    return load_config(str(path))


def where(plan, role):
    """rank -> [(node, gpu)] of `role` in the plan."""
    out = {}
    for (node, gpu), device in sorted(plan.devices.items()):
        for o in device.occupants:
            if o.role == role:
                out.setdefault(o.rank, []).append((node, gpu))
    return out


def test_fits_one_node_with_tp_groups_and_zero_shards_where_the_mapping_says(tmp_path):
    plan = plan_cluster(load(tmp_path), ClusterSpec.described(1, 8, 80), shape=QWEN25_7B)
    assert plan.problems == []
    assert where(plan, "actor_train") == {r: [(0, r)] for r in range(4)}
    assert where(plan, "actor_infer") == {0: [(0, 4), (0, 5)], 1: [(0, 6), (0, 7)]}  # one TP group per rank
    gpu4 = plan.devices[(0, 4)].occupants[0]
    assert gpu4.claim == pytest.approx(0.85 * 80 * GIB) and set(gpu4.parts) == {"weights", "kv_cache"}
    assert set(plan.devices[(0, 0)].occupants[0].parts) == {"weights", "gradients", "optimizer", "activations"}
    text = plan.text()
    assert "GPU 4: 68.00 GiB of 80 GiB (85%)" in text and "actor_infer rank 0 (vLLM, TP worker 1 of 2)" in text
    assert "needs 2 nodes" not in text and "memory: fits" in text


def test_does_not_fit_names_the_device_and_by_how_much(tmp_path):
    plan = plan_cluster(load(tmp_path), ClusterSpec.described(1, 8, 32), shape=QWEN25_7B)
    train = [p for p in plan.problems if "actor_train rank 0" in p]
    assert len(train) == 1 and train[0].startswith("does not fit: node 0 GPU 0 of 32 GiB")
    over = float(re.search(r"over by ([\d.]+) GiB", train[0]).group(1))
    need = sum(plan.devices[(0, 0)].occupants[0].parts.values()) / GIB
    assert over == pytest.approx(need - 0.9 * 32, abs=0.01)  # against 90 % of the device
    assert "the same on 3 more GPU(s): node 0 GPU 1-3" in train[0]
    # vLLM's share of 32 GiB cannot hold its weight shard and KV cache: named with the key to change.
    assert any("actor_infer rank 0" in p and "gpu_memory_utilization = 0.85 of 32 GiB" in p and "short by" in p
               for p in plan.problems)


def test_needs_two_nodes_is_visible_and_a_one_node_cluster_is_too_small(tmp_path):
    cfg = load(tmp_path, actor_train={"device_mapping": "list(range(0,12))",
                                      "training_args": {"per_device_train_batch_size": 1}},
               actor_infer={"device_mapping": "list(range(12,16))"}, rollout_batch_size=48)
    unchecked = plan_cluster(cfg, ClusterSpec(8), shape=QWEN3_30B)  # no cluster described: only what it needs
    assert unchecked.problems == [] and "on 2 node(s): needs 2 nodes" in unchecked.text()
    assert where(unchecked, "actor_infer") == {0: [(1, 4), (1, 5)], 1: [(1, 6), (1, 7)]}
    assert plan_cluster(cfg, ClusterSpec.described(2, 8, 80), shape=QWEN3_30B).problems == []
    small = plan_cluster(cfg, ClusterSpec.described(1, 8, 80), shape=QWEN3_30B)
    assert any(p.startswith("the cluster is too small: the roles need 16 GPUs on 2 node(s)")
               and "it has 8 GPUs on 1 node(s)" in p for p in small.problems)
    assert any(p.startswith("actor_infer.device_mapping names GPUs that do not exist: 12-15") for p in small.problems)
    assert "node 1 (MISSING: not in the cluster" in small.text()


def test_mapping_past_the_nodes_gpus_and_tp_groups_across_nodes_are_refused(tmp_path):
    # The config says 8 GPUs per node; the nodes have 4: GPUs 4-7 of node index 0 do not exist.
    plan = plan_cluster(load(tmp_path), ClusterSpec.described(2, 4, 80), shape=QWEN25_7B)
    assert any(p.startswith("actor_infer.device_mapping names GPUs that do not exist: 4-7")
               and "set num_gpus_per_node to the GPUs each node has" in p for p in plan.problems)
    with pytest.raises(ConfigError, match=r"actor_infer.device_mapping: rank 0 would span nodes \[0, 1\].*tensor-parallel"):
        load(tmp_path, actor_infer={"device_mapping": "[7,8]"})
    # Without a device_mapping Ray places a rank's GPUs on one node: a TP group larger than a node cannot go.
    cfg = load(tmp_path, actor_train={"device_mapping": None, "world_size": 1, "num_gpus_per_worker": 1},
               actor_infer={"device_mapping": None, "world_size": 1, "num_gpus_per_worker": 2})
    problems = plan_cluster(cfg, ClusterSpec.described(2, 1, 80), shape=QWEN25_7B).problems
    assert any("actor_infer: a rank needs 2 GPUs on one node" in p for p in problems)


def test_a_rank_larger_than_the_free_nodes_is_named_not_searched_for_forever(tmp_path):
    from roll_gspo.placement.cluster_plan import NodeSpec

    cfg = load(tmp_path, actor_train={"device_mapping": None, "world_size": 1, "num_gpus_per_worker": 1},
               actor_infer={"device_mapping": None, "world_size": 2, "num_gpus_per_worker": 2})
    cluster = ClusterSpec(1, [NodeSpec("big", 3), NodeSpec("small", 1)], 80, "two unequal nodes")
    plan = plan_cluster(cfg, cluster, shape=QWEN25_7B)  # train: GPU 0; rollout rank 0: GPUs 1-2; rank 1: none
    assert where(plan, "actor_infer") == {0: [(0, 1), (0, 2)]}
    assert any("actor_infer: a rank needs 2 GPUs on one node" in p for p in plan.problems)


def test_colocated_roles_add_up_on_their_gpus_unless_they_free_memory_between_phases(tmp_path):
    shared = {"device_mapping": "list(range(0,8))"}
    cfg = load(tmp_path, actor_train={**shared, "training_args": {"per_device_train_batch_size": 1}},
               actor_infer={**shared, "strategy_args": {"strategy_config": {"gpu_memory_utilization": 0.4}}})
    cfg.is_offload_states = False  # colocation's switch (set here whether or not the schema has it yet)
    plan = plan_cluster(cfg, ClusterSpec.described(1, 8, 80), shape=QWEN25_7B)
    device = plan.devices[(0, 0)]
    assert [o.role for o in device.occupants] == ["actor_train", "actor_infer"]
    train = device.occupants[0].parts
    assert sum(device.peak()) == pytest.approx(sum(train.values()) + 0.4 * 80 * GIB)  # the two add up
    assert plan.problems == []
    cfg.actor_infer.strategy_args.strategy_config["gpu_memory_utilization"] = 0.85
    crowded = plan_cluster(cfg, ClusterSpec.described(1, 8, 80), shape=QWEN25_7B)
    assert crowded.problems and all("2 ranks share this GPU and add up" in p for p in crowded.problems)
    # vLLM asleep while training, DeepSpeed's states on CPU while generating: the peak is one phase's.
    cfg.is_offload_states = True
    offloaded = plan_cluster(cfg, ClusterSpec.described(1, 8, 80), shape=QWEN25_7B)
    peak = offloaded.devices[(0, 0)].peak()
    assert sum(peak) == pytest.approx(max(sum(train.values()), train["weights"] + 0.85 * 80 * GIB))
    assert offloaded.problems == [] and "asleep while training" in offloaded.text()


def test_fractional_gpus_share_one_device_as_ray_packs_them(tmp_path):
    cfg = load(tmp_path, actor_train={"device_mapping": None, "world_size": 1, "num_gpus_per_worker": 0.5},
               actor_infer={"device_mapping": None, "world_size": 1, "num_gpus_per_worker": 0.5,
                            "strategy_args": {"strategy_config": {"tensor_parallel_size": 1,
                                                                  "gpu_memory_utilization": 0.4}}})
    plan = plan_cluster(cfg, ClusterSpec.described(1, 1, 80), shape=QWEN25_7B)
    assert where(plan, "actor_train") == where(plan, "actor_infer") == {0: [(0, 0)]}


def test_each_node_index_gets_a_node_of_its_own():
    # Two node indices of 2 GPUs fit one 8-GPU node by resources; device_mapping means two nodes.
    assert assign_node_indices({0: (2, 1), 1: (2, 1)}, [{"GPU": 8, "CPU": 8}, {"GPU": 8, "CPU": 8}]) == {0: 0, 1: 1}
    assert assign_node_indices({0: (2, 1), 1: (2, 1)}, [{"GPU": 8, "CPU": 8}]) == {0: 0, 1: None}
    # Node 0 is too small for node index 0: it moves to the node that fits, node index 1 takes node 0.
    assert assign_node_indices({0: (4, 1), 1: (1, 1)}, [{"GPU": 2, "CPU": 8}, {"GPU": 4, "CPU": 8}]) == {0: 1, 1: 0}


def test_ray_nodes_describe_the_cluster(tmp_path):
    records = [{"NodeManagerAddress": "10.0.0.1", "NodeID": "aa" * 28, "Alive": True, "Resources": {"GPU": 8.0, "CPU": 64.0}},
               {"NodeManagerAddress": "10.0.0.2", "NodeID": "bb" * 28, "Alive": False, "Resources": {"GPU": 8.0}}]
    cluster = ClusterSpec.from_ray_nodes(records, 8, 80, "10.0.0.1:6379")
    assert [(n.gpus, n.cpus) for n in cluster.nodes] == [(8, 64.0)]  # the dead node does not count
    assert plan_cluster(load(tmp_path), cluster, shape=QWEN25_7B).problems == []


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "2"], "--nodes needs --dry-run"), (["--dry-run", "--gpus-per-node", "0"], "--gpus-per-node needs"),
    (["--dry-run", "--nodes", "1", "--ray-address", "auto"], "--ray-address needs --dry-run and replaces --nodes")])
def test_cluster_flags_without_dry_run_or_out_of_range_are_refused(argv, message, capsys):
    from roll_gspo.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--config", "example_gspo.yaml", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
