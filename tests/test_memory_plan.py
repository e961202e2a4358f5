"""Per-device memory estimate (roll_gspo.memory_plan): pure arithmetic against published sizes."""
import pytest

from roll_gspo.memory_plan import GIB, DeviceUse, ModelShape, plan_problems, rollout_memory, training_memory

QWEN25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False)
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)


@pytest.mark.parametrize("config, billions", [(QWEN25_7B, 7.62), (QWEN25_05B, 0.494), (QWEN3_30B_A3B, 30.5)])
def test_parameter_count_matches_published_size(config, billions):
    assert ModelShape.from_hf_config(config).num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_zero_stages_shard_what_the_paper_says():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    p = shape.num_parameters()
    by_stage = {stage: training_memory(shape, dtype="bf16", zero_stage=stage, world_size=8, micro_batch=1, seq_len=1024)
                for stage in range(4)}
    assert by_stage[0]["weights"] == by_stage[2]["weights"] == 2 * p and by_stage[3]["weights"] == 2 * p / 8
    assert by_stage[1]["gradients"] == 2 * p and by_stage[2]["gradients"] == 2 * p / 8
    assert by_stage[0]["optimizer"] == 12 * p and by_stage[1]["optimizer"] == 12 * p / 8  # fp32 master + 2 moments
    fp32 = training_memory(shape, dtype="fp32", zero_stage=0, world_size=1, micro_batch=1, seq_len=1024)
    assert fp32["optimizer"] == 8 * p  # no master copy
    longer = training_memory(shape, dtype="bf16", zero_stage=3, world_size=8, micro_batch=2, seq_len=1024)
    assert longer["activations"] == pytest.approx(2 * by_stage[3]["activations"])


def test_kv_cache_and_weights_split_over_tensor_parallel_ranks():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    one = rollout_memory(shape, dtype="bf16", tensor_parallel_size=1, max_num_seqs=64, max_model_len=4096)
    two = rollout_memory(shape, dtype="bf16", tensor_parallel_size=2, max_num_seqs=64, max_model_len=4096)
    assert two["weights"] == one["weights"] / 2 and two["kv_cache"] == one["kv_cache"] / 2
    # 2 (k, v) * 28 layers * 4 kv heads * 128 * 2 bytes = 56 KiB per token
    assert one["kv_cache"] == 56 * 1024 * 64 * 4096


def test_fits_and_does_not_fit_with_the_reason():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    train = training_memory(shape, dtype="bf16", zero_stage=3, world_size=8, micro_batch=1, seq_len=2048)
    fits = DeviceUse("node0/gpu0", 80 * GIB, roles={"actor_train": train})
    assert plan_problems([fits]) == []
    one_gpu = training_memory(shape, dtype="bf16", zero_stage=3, world_size=1, micro_batch=1, seq_len=2048)
    problems = plan_problems([DeviceUse("node0/gpu0", 80 * GIB, roles={"actor_train": one_gpu})])
    assert len(problems) == 1 and "node0/gpu0" in problems[0] and "optimizer" in problems[0]
    rollout = rollout_memory(shape, dtype="bf16", tensor_parallel_size=1, max_num_seqs=256, max_model_len=4096)
    shared = DeviceUse("node0/gpu0", 80 * GIB, roles={"actor_infer": rollout}, limits={"actor_infer": 0.5})
    assert any("actor_infer needs" in p and "may use 0.5 x" in p for p in plan_problems([shared]))
    assert "actor_infer:" in shared.describe()


def test_dry_run_prints_the_plan_and_refuses_what_does_not_fit(tmp_path, tiny_model):
    from roll_gspo.cli import main

    config = str(tmp_path / "c.yaml")
    with open(config, "w") as handle:
        handle.write(f"pretrain: {tiny_model}\nactor_train:\n  data_args:\n    file_name: [builtin:arith/train]\n")
    # The default batch: 64 prompts x 8 responses of 6144 tokens hold ~3 GiB of the tiny model's KV cache.
    assert main(["--config", config, "--dry-run", "--device-memory-gb", "8"]) == 0
    assert main(["--config", config, "--dry-run", "--device-memory-gb", "1"]) == 1


@pytest.mark.parametrize("recipe, config", [("qwen2.5-7b_8gpu.yaml", QWEN25_7B),
                                            ("qwen3-30b-a3b_16gpu.yaml", QWEN3_30B_A3B)])
def test_gpu_recipe_passes_dry_run_on_80gb_devices_and_not_on_24gb(tmp_path, recipe, config):
    """configs/gpu/ recipes against a folder holding only the model's config.json."""
    import json
    from pathlib import Path

    from roll_gspo.cli import main

    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "gpu" / recipe)
    args = ["--config", recipe, "--dry-run", f"pretrain={tmp_path}"]
    assert main(args + ["--device-memory-gb", "80"]) == 0
    assert main(args + ["--device-memory-gb", "24"]) == 1


@pytest.mark.parametrize("argv", [["--device-memory-gb", "80"], ["--dry-run", "--device-memory-gb", "0"],
                                  ["--dry-run", "--device-memory-gb", "-8"]])
def test_device_memory_flag_without_dry_run_or_with_no_size_is_refused(argv, capsys):
    from roll_gspo.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--config", "example_gspo.yaml", *argv])
    assert info.value.code == 2 and "--device-memory-gb needs --dry-run" in capsys.readouterr().err
