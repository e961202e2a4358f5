"""Host memory of CPU runs: the `--dry-run` plan (roll_gspo.placement.host_memory), the built-in
0.5B-shaped model it plans for without building it, and a worker killed for memory reported in one
line. Nothing here runs a 0.5B model."""
import json
from pathlib import Path

import pytest

from roll_gspo.placement.host_memory import (JEMALLOC_RETENTION, TRAIN_RUNTIME, VLLM_RUNTIME, plan_host_memory,
                                             train_rank_memory, vllm_rank_memory)
from roll_gspo.config.plan.model_shape import policy_shape
from roll_gspo.placement.memory import GIB, ModelShape

QWEN25_05B = json.loads((Path(__file__).resolve().parent / "data" / "model_configs" / "Qwen2.5-0.5B.json").read_text())
# A small shape with every term nonzero: 2 layers, hidden 64, vocabulary 1000, tied embeddings.
SMALL = ModelShape(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                   intermediate_size=128, tie_word_embeddings=True, attention_bias=True)


def test_training_rank_arithmetic_by_zero_stage():
    p = SMALL.num_parameters()
    one = dict(micro_batch_tokens=100, logit_tokens=80, score_tokens=120, gradient_checkpointing=False)
    zero0 = train_rank_memory(SMALL, dtype="fp32", zero_stage=0, world_size=1, jemalloc=False, **one)
    assert (zero0["runtime"], zero0["weights"], zero0["gradients"], zero0["optimizer"]) == (TRAIN_RUNTIME, 4 * p, 4 * p,
                                                                                           8 * p)  # 16 bytes/parameter
    per_token_layer = 8 * 64 + 2 * 32 + 4 * 128
    assert zero0["activations"] == 100 * 2 * per_token_layer * 4
    # fp32 logits and their gradient, and the (V, H) gradients of the head and the embedding (> the scoring pass's 120 rows)
    assert zero0["logits"] == 2 * 80 * 1000 * 4 + 2 * 4 * 1000 * 64
    # ZeRO-2 over 2 ranks: DeepSpeed's fp32 master copy and gradient partition, halved; whole gradients in flight.
    zero2 = train_rank_memory(SMALL, dtype="fp32", zero_stage=2, world_size=2, jemalloc=False, **one)
    assert zero2["optimizer"] == (8 * p + 4 * p) / 2 and zero2["gradients"] == 4 * p / 2 + 4 * p
    # ZeRO-1/2 on one rank shard nothing and still add 8 bytes per parameter over stage 0.
    zero2_one = train_rank_memory(SMALL, dtype="fp32", zero_stage=2, world_size=1, jemalloc=False, **one)
    assert sum(zero2_one.values()) - sum(zero0.values()) == 8 * p
    zero3 = train_rank_memory(SMALL, dtype="bf16", zero_stage=3, world_size=4, jemalloc=False, **one)
    assert zero3["weights"] == 2 * p / 4 and zero3["optimizer"] == 12 * p / 4
    checkpointed = train_rank_memory(SMALL, dtype="fp32", zero_stage=0, world_size=1, jemalloc=False,
                                     **{**one, "gradient_checkpointing": True})
    assert checkpointed["activations"] == 100 * (2 * 64 + per_token_layer) * 4
    lora = train_rank_memory(SMALL, dtype="fp32", zero_stage=0, world_size=1, jemalloc=False, trainable=1000, **one)
    assert (lora["weights"], lora["gradients"], lora["optimizer"]) == (4 * (p + 1000), 4 * 1000, 8 * 1000)
    assert lora["logits"] == 2 * 80 * 1000 * 4  # the frozen head and embedding have no gradients
    retained = train_rank_memory(SMALL, dtype="fp32", zero_stage=0, world_size=1, jemalloc=True, **one)
    assert retained["allocator_headroom"] == pytest.approx(JEMALLOC_RETENTION * (zero0["activations"] + zero0["logits"]))


def test_rollout_rank_holds_packed_weights_kv_cache_and_a_sync():
    p = SMALL.num_parameters()
    parts = vllm_rank_memory(SMALL, dtype="fp32", kv_cache_bytes=GIB, bucket_bytes=1 << 20, jemalloc=False,
                             max_num_seqs=32)
    assert parts["runtime"] == VLLM_RUNTIME and parts["weights"] == 4 * p and parts["kv_cache"] == GIB
    assert parts["sampler"] == 4 * 32 * 1000 * 4  # fp32 vocabulary rows per sequence slot
    assert parts["packed_lm_head"] == 4 * 1000 * 64  # the LM head's oneDNN copy beside the plain embedding
    # a bucket (at least the embedding) mapped + the widest layer (gate/up); copied out as well by layerwise reloads
    bucket = max(min(1 << 20, 4 * p), 4 * 1000 * 64)
    assert parts["weight_sync"] == bucket + 4 * 64 * 2 * 128
    layerwise = vllm_rank_memory(SMALL, dtype="fp32", kv_cache_bytes=GIB, bucket_bytes=1 << 20, jemalloc=False,
                                 max_num_seqs=32, copies_bucket=True)
    assert layerwise["weight_sync"] == 2 * bucket + 4 * 64 * 2 * 128


def _example(*overrides):
    from roll_gspo.config import load_config

    return load_config("example_gspo_0.5b_cpu.yaml", list(overrides))


def test_the_05b_recipe_fits_24_gib_and_not_12_naming_role_and_knobs():
    shape = policy_shape(_example())
    assert shape == ModelShape.from_hf_config(QWEN25_05B)  # the built-in's registered shape, not built
    fits = plan_host_memory(_example(), shape, 24 * GIB, "test")
    assert not fits.problems
    train = fits.process("actor_train")
    p = shape.num_parameters()
    assert train.count == 1 and train.parts["weights"] + train.parts["gradients"] + train.parts["optimizer"] == 16 * p
    # micro-batch 4 x (256 responses + 1) positions, and the head's and embedding's (V, H) gradients
    assert train.parts["logits"] == 2 * 2 * 257 * 151936 * 4 + 2 * 4 * 151936 * 896  # micro-batch 2
    assert fits.process("actor_infer").parts["sampler"] == 4 * 32 * 151936 * 4  # max_num_seqs 32
    small = plan_host_memory(_example(), shape, 12 * GIB, "test")
    (problem,) = small.problems
    assert "does not fit" in problem and f"actor_train {train.each / GIB:.2f} GiB" in problem
    assert "per_device_train_batch_size below 2" in problem and "VLLM_CPU_KVCACHE_SPACE" in problem
    # Two ZeRO-2 ranks (the small example's layout) on one host: each holds the model state.
    two = plan_host_memory(_example("actor_train.world_size=2", "actor_train.strategy_args.strategy_config."
                                    "zero_optimization.stage=2"), shape, 24 * GIB, "test")
    assert two.process("actor_train").count == 2 and "actor_train.world_size: 1" in two.problems[0]


def test_jemalloc_at_05b_is_refused_unless_it_decays_and_auto_picks_the_system_malloc():
    """Measured at 0.5B: jemalloc without decay grew a training rank without bound (6.6 -> 19.5 GiB
    over 12 micro-batches, killed by Ray); with `dirty_decay_ms:1000` it peaked at 9.73 GiB, the
    system allocator at 12.28 (the recipe's micro-batch 2 x 4). The plan: auto -> system, explicit
    jemalloc refused naming `memory_allocator: system`, a finite decay planned within 25%."""
    shape = policy_shape(_example())
    auto = plan_host_memory(_example("memory_allocator=auto"), shape, 23.5 * GIB, "test")
    assert not auto.problems and "allocator_headroom" not in auto.process("actor_train").parts
    system = plan_host_memory(_example(), shape, 23.5 * GIB, "test")
    assert 0.75 <= 12.28 / (system.process("actor_train").each / GIB) <= 1.25
    jemalloc = plan_host_memory(_example("memory_allocator=jemalloc"), shape, 23.5 * GIB, "test")
    assert any("grew by ~1 GiB per micro-batch" in p and "memory_allocator: system" in p for p in jemalloc.problems)
    decaying = plan_host_memory(_example(
        "memory_allocator=jemalloc", 'system_envs.MALLOC_CONF="dirty_decay_ms:1000,muzzy_decay_ms:0"',
        "response_length=128", "actor_train.training_args.per_device_train_batch_size=1",
        "actor_train.training_args.gradient_accumulation_steps=8"), shape, 23.5 * GIB, "test")
    assert not decaying.problems
    train = decaying.process("actor_train")
    assert train.parts["allocator_headroom"] == pytest.approx(
        JEMALLOC_RETENTION * (train.parts["activations"] + train.parts["logits"]))
    assert 0.75 <= 9.73 / (train.each / GIB) <= 1.25


def test_dry_run_prints_the_host_plan_without_building_the_model(tmp_path, monkeypatch, capsys):
    from roll_gspo.cli import main

    monkeypatch.setenv("ROLL_GSPO_CACHE", str(tmp_path / "cache"))
    assert main(["--config", "example_gspo_0.5b_cpu.yaml", "--dry-run", "--host-memory-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert "host memory plan" in out and "actor_train (DeepSpeed ZeRO-0, fp32" in out and ": fits (" in out
    assert not (tmp_path / "cache" / "models").exists()  # planned from the registered shape: nothing built
    assert main(["--config", "example_gspo_0.5b_cpu.yaml", "--dry-run", "--host-memory-gb", "10",
                 "response_length=1024"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "host memory: does not fit" in err and "actor_train" in err, err


@pytest.mark.parametrize("argv", [["--host-memory-gb", "24"], ["--dry-run", "--host-memory-gb", "0"]])
def test_host_memory_flag_needs_dry_run_and_a_size(argv, capsys):
    from roll_gspo.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--config", "example_gspo.yaml", *argv])
    assert info.value.code == 2 and "--host-memory-gb needs --dry-run" in capsys.readouterr().err


def test_the_opd_teacher_is_a_process_of_the_plan_with_its_own_shape():
    """A teacher scores like the reference, with its own model's shape; one whose shape is unknown is
    noted, not counted as nothing."""
    from roll_gspo.config import load_config

    cfg = load_config("example_opd_smollm2.yaml", ["actor_train.model_args.dtype=fp32", "actor_infer.model_args.dtype=fp32",
                                                   "teacher.model_args.dtype=fp32"])
    teacher = ModelShape.from_hf_config(QWEN25_05B)
    plan = plan_host_memory(cfg, SMALL, 24 * GIB, "test", {"teacher": teacher})
    estimate = plan.process("teacher")
    assert estimate is not None and estimate.count == 1 and estimate.what == "hf_infer, fp32"
    assert estimate.parts["weights"] == 4.0 * teacher.num_parameters()
    unknown = plan_host_memory(cfg, SMALL, 24 * GIB, "test")
    assert unknown.process("teacher") is None and any(n.startswith("teacher: the shape of") for n in unknown.notes)


def test_gpu_runs_get_no_host_plan():
    assert plan_host_memory(_example("actor_train.num_gpus_per_worker=1"), SMALL, 24 * GIB, "test") is None


def test_builtin_05b_shape_is_registered_and_a_shaped_model_builds_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_gspo.builtin.models import (QWEN25_05B_SHAPE, builtin_max_positions, builtin_model_config,
                                          write_shaped_model)
    from roll_gspo.config.checks.preflight import model_max_positions

    config = builtin_model_config("builtin:qwen2.5-0.5b-shape")
    assert ModelShape.from_hf_config(config).num_parameters() / 1e9 == pytest.approx(0.494, rel=0.01)
    assert builtin_max_positions("builtin:qwen2.5-0.5b-shape") == model_max_positions("builtin:qwen2.5-0.5b-shape") == 32768
    # The same builder at a small shape: transformers loads it, with the tied head and the char tokenizer.
    small = {**QWEN25_05B_SHAPE, "vocab_size": 512,
             "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 128, "max_position_embeddings": 1024}
    write_shaped_model(str(tmp_path), small, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    shape = ModelShape.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert float(model.model.layers[0].mlp.up_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.1)
    assert len(AutoTokenizer.from_pretrained(str(tmp_path))) == 100


# --------------------------------------------------------------------------------------------
# A worker killed for memory: one line naming the rank and its memory
# --------------------------------------------------------------------------------------------
RAY_OOM = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.7, ID: 8c5a14) "
           "where the task (actor ID: f9cc34, name=ActorTrainWorker.train_step, pid=4331, memory used=10.52GB) was "
           "running was 22.41GB / 23.45GB (0.955), which exceeds the memory usage threshold of 0.95. Ray killed this "
           "worker (ID: d98ac9) because it was the most recently scheduled task; to see more information ...\n"
           "Top 10 memory users:\nPID\tMEM(GB)\tCOMMAND\n4331\t10.52\tray::ActorTrainWorker.train_step")


def test_memory_kill_message_names_the_rank_and_its_memory():
    from roll_gspo.distributed.cluster import describe_memory_kill

    line = describe_memory_kill(RAY_OOM, {4331: "role actor_train rank 1"})
    assert "\n" not in line and line.startswith("role actor_train rank 1 was killed for memory by Ray holding 10.52GB")
    assert "22.41GB of 23.45GB (Ray's threshold: 0.95)" in line and "--dry-run" in line
    unknown = describe_memory_kill(RAY_OOM, {}, "role actor_infer rank 0")
    assert unknown.startswith("role actor_infer rank 0 (ActorTrainWorker.train_step, pid 4331) was killed")


def test_memory_kill_of_several_workers_pairs_each_pid_with_its_own_memory():
    """Ray >= 2.56 may kill several workers at once and lists each with its memory: the line must
    not give the failed rank another process's figure (it once said "actor_train ... holding 0.01GB",
    the reward worker's)."""
    from roll_gspo.distributed.cluster import describe_memory_kill

    text = ("Task was killed due to the node running low on memory. (actor ID: 8cf3af, name=ActorTrainWorker.train_step, "
            "pid=28467) Ray killed 3 worker(s) based on the killing policy\nSelected to kill: (Actor(2f3f27): "
            "task name=MathRuleRewardWorker.__init__, pid=28589, actual memory used=0.01GB, worker ID=4f17)\n"
            "Selected to kill: (Actor(f16e4c): task name=ActorInferWorker.__init__, pid=28508, actual memory "
            "used=5.20GB, worker ID=f3f0)\nSelected to kill: (Actor(8cf3af): task name=ActorTrainWorker.__init__, "
            "pid=28467, actual memory used=15.01GB, worker ID=fae6)")
    line = describe_memory_kill(text, {28467: "role actor_train rank 0", 28508: "role actor_infer rank 0"})
    assert "\n" not in line and line.startswith("role actor_train rank 0 was killed for memory by Ray holding 15.01GB; "
                                               "Ray also killed pid 28589 (0.01GB), role actor_infer rank 0 (5.20GB)")


def test_gather_turns_rays_out_of_memory_error_into_one_line(monkeypatch):
    import ray

    from roll_gspo.distributed import cluster as cluster_module
    from roll_gspo.distributed.cluster import Cluster, WorkerDiedError

    def fake_get(ref, timeout=None):
        if ref == "where 0":
            return ("10.0.0.7", 4331)
        raise ray.exceptions.OutOfMemoryError(RAY_OOM)

    monkeypatch.setattr(ray, "get", fake_get)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (refs[:1], refs[1:]))
    cluster = Cluster.__new__(Cluster)
    cluster.name, cluster.workers, cluster.placement_group, cluster._whereabouts = "actor_train", [], None, ["where 0"]
    cluster._sent, cluster.deadlines = {}, None  # built without __init__: no bounded waits
    monkeypatch.setattr(cluster_module, "_CLUSTERS", {cluster})
    with pytest.raises(WorkerDiedError) as info:
        cluster.gather(["call on rank 0"])
    message = str(info.value)
    assert "\n" not in message and message.startswith("role actor_train rank 0 was killed for memory by Ray holding "
                                                      "10.52GB"), message


def test_cli_reports_a_memory_kill_outside_a_gather_in_one_line(monkeypatch, capsys):
    import ray

    import pipelines
    from roll_gspo.cli import main

    def run(cfg):
        raise ray.exceptions.OutOfMemoryError(RAY_OOM)

    monkeypatch.setattr(pipelines, "run_pipeline_from_config", run)
    assert main(["--config", "example_gspo.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was killed for memory by Ray holding 10.52GB" in err, err
