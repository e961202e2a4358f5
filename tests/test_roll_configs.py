"""ROLL's configuration surface: ROLL YAMLs (tests/data/roll/, written in ROLL's format) load,
dry-run and train here; every ROLL key acts or is refused with its reason.

Fast tests need no Ray; the two marked e2e run 2 steps of the ROLL YAMLs on CPU.
"""
import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roll_gspo.config import ConfigError, load_config, preflight
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.roll import roll_compat
from roll_gspo.config.typed_walk import schema_paths

REPO = Path(__file__).resolve().parents[1]
ROLL_DIR = REPO / "tests" / "data" / "roll"
ZERO3_SP2 = ROLL_DIR / "rlvr_zero3_sp2.yaml"
GSPO = ROLL_DIR / "example_gspo.yaml"

# ROLL's GPU placement, dropped for a CPU run on the command line (README: "a ROLL YAML runs on a
# CPU machine by dropping the mappings"); each role then runs world_size ranks on CPUs.
GPU_PLACEMENT = ("actor_train.device_mapping", "actor_infer.device_mapping", "reference.device_mapping")


def _declared(path: str) -> bool:
    paths = set(schema_paths(PipelineConfig))
    return path in paths


def cpu_overrides(yaml_path: Path, output_dir) -> list:
    """The GPU placement of ROLL's YAMLs turned into a CPU run, on the command line."""
    over = [f"{key}=null" for key in GPU_PLACEMENT]
    over += ["actor_infer.strategy_args.strategy_config.block_size=32",  # vLLM's CPU attention
             "rewards.math_rule.world_size=1", "max_steps=2", f"output_dir={output_dir}",
             f"logging_dir={output_dir}/logs", f"checkpoint_config.output_dir={output_dir}/ckpt",
             f"tracker_kwargs.log_dir={output_dir}/tb"]
    if yaml_path == ZERO3_SP2:  # FlashAttention and sequence parallelism are GPU-only
        over += [f"{role}.model_args.attn_implementation=sdpa" for role in ("actor_train", "actor_infer", "reference")]
        over += ["actor_train.model_args.ulysses_size=1", "reference.model_args.ulysses_size=1"]
    return over


@pytest.fixture
def in_roll_dir(monkeypatch):
    monkeypatch.chdir(ROLL_DIR)  # ROLL runs from its repository root; its data paths are relative


def load_roll(path, overrides=(), tmp="/tmp/unused"):
    return load_config(str(path), cpu_overrides(Path(path), tmp) + list(overrides))


def refusal(path, overrides, tmp="/tmp/unused"):
    with pytest.raises(ConfigError) as info:
        load_roll(path, overrides, tmp)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# The two ROLL files: they load, every key lands where it should, --dry-run passes
# --------------------------------------------------------------------------------------------
def test_zero3_sp2_loads_with_roll_semantics(in_roll_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = load_roll(ZERO3_SP2)
    ds = cfg.actor_train.strategy_args.strategy_config
    assert ds["zero_optimization"]["stage"] == 3          # ${deepspeed_zero3} via the defaults list
    assert ds["bf16"]["enabled"] == "auto"                # follows model_args.dtype
    assert cfg.reference.strategy_args.strategy_name == "deepspeed_infer"
    assert cfg.actor_train.model_args.gradient_checkpointing is True    # disable_gradient_checkpointing: false
    assert cfg.actor_infer.model_args.gradient_checkpointing is False
    assert cfg.actor_train.data_args.messages_key == "messages"
    assert cfg.actor_train.data_args.interleave_probs is None            # "1.0": concatenation
    assert cfg.rewards["math_rule"].worker_cls == "roll_gspo.workers.rewards.MathRuleRewardWorker"
    assert cfg.rewards["math_rule"].model_args.model_name_or_path == "builtin:tiny-arith-base"
    assert cfg.reward_norm is None and not cfg.reward_shift and not cfg.reward_scale
    assert cfg.logging_dir == "/tmp/unused/tb"    # ROLL's tensorboard folder is tracker_kwargs.log_dir
    assert cfg.validation.data_args.template == "qwen2_5"
    assert "deepspeed_zero3" not in dataclasses.asdict(cfg)               # presets are anchors
    assert any("value_clip = 0.5 has no effect" in r.message for r in caplog.records)


def test_gspo_example_loads(in_roll_dir):
    cfg = load_roll(GSPO)
    assert cfg.importance_sampling == "seq" and cfg.use_kl_loss
    assert cfg.actor_train.strategy_args.strategy_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg.reference.strategy_args.strategy_config["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("path", [ZERO3_SP2, GSPO], ids=["zero3_sp2", "gspo"])
def test_dry_run_passes(path, tmp_path, session_cache):
    result = subprocess.run(
        [sys.executable, str(REPO / "run_pipeline.py"), "--config", path.name, "--dry-run",
         *cpu_overrides(path, tmp_path)],
        cwd=ROLL_DIR, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run: config" in result.stdout


def test_megatron_names_get_what_to_use_instead(in_roll_dir):
    message = refusal(GSPO, ["actor_train.strategy_args.strategy_name=megatron_train",
                             "reference.strategy_args.strategy_name=megatron_infer",
                             "actor_infer.strategy_args.strategy_name=sglang"])
    assert "strategy 'megatron_train' is not built here; use `strategy_name: deepspeed_train`" in message
    assert "strategy 'megatron_infer' is not built here; use `strategy_name: deepspeed_infer`" in message
    assert "strategy 'sglang' is not built here; use `strategy_name: vllm`" in message


def test_megatron_strategy_config_after_a_rename_acts_or_is_refused(in_roll_dir):
    # ROLL v0.3's recipes set these under megatron_train; renamed to deepspeed_train they act in
    # DeepSpeed's form (sizes of 1: data parallelism; distributed optimizer: ZeRO-1; full recompute:
    # gradient checkpointing) ...
    cfg = load_roll(GSPO, ["actor_train.strategy_args.strategy_config={tensor_model_parallel_size: 1, "
                           "use_distributed_optimizer: true, recompute_granularity: full}"])
    assert cfg.actor_train.strategy_args.strategy_config["zero_optimization"] == {"stage": 1}
    assert cfg.actor_train.model_args.gradient_checkpointing
    # ... and what cannot act is refused with its reason.
    message = refusal(GSPO, ["actor_train.strategy_args.strategy_config={tensor_model_parallel_size: 2}"])
    assert "tensor_model_parallel_size = 2: Megatron model parallelism is not built" in message
    message = refusal(GSPO, ["actor_train.strategy_args.strategy_config={recompute_granularity: selective}"])
    assert "only `full` (every layer, gradient checkpointing) is built here" in message
    message = refusal(GSPO, ["actor_train.strategy_args.strategy_config={sequence_parallel: true}"])
    assert "Megatron/FSDP options, which DeepSpeed would silently ignore" in message


# --------------------------------------------------------------------------------------------
# Refused keys print their reason
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, reason", [
    ("actor_train.model_args.ulysses_size=2", "sequence parallelism is not built"),
    ("actor_infer.generating_args.num_beams=4", "beam search is not built"),
    ("reference.model_args.lora_target=q_proj", "the reference is the base model"),
    ("+lora_rank=32", "top-level lora_rank set, but no role's model_args uses it"),
    ("actor_train.use_dynamic_batching_in_train=true", "must be set to at least one whole sequence"),
    ("actor_infer.use_dynamic_batching_in_infer=true", "vLLM schedules its own batches"),
    ("async_generation_ratio=2.5", "or an integer k >= 2 (a staleness bound"),
    ("is_num_return_sequences_expand=true", "samples num_return_sequences_in_group"),
    ("+rollout_mock={enable: true}", "rollout dumping/mocking is not built"),
    ("actor_train.data_args.interleave_probs='0.5,0.5'", "per-file sampling is not built"),
    ("adv_estimator=gae", "adv_estimator: gae needs a `critic` block"),
    ("actor_train.data_args.template=base", "fixed instruction text"),
    ("actor_train.model_args.model_type=trl", "a policy role is a causal LM"),
    ("checkpoint_config.type=oss", "valid values: 'file_system'"),
    ("actor_train.strategy_args.strategy_config.bf16.enabled=true", "contradicts actor_train.model_args.dtype = fp32"),
])
def test_refused_key_prints_reason(in_roll_dir, override, reason):
    extra = ["actor_train.model_args.dtype=fp32"] if "bf16.enabled" in override else []
    assert reason in refusal(GSPO, [override, *extra])


def test_sequence_packing_acts_as_token_budget_micro_batches(in_roll_dir, caplog):
    """ROLL's packing (Megatron only there) becomes dynamic batching with its budgets, said once; a
    missing budget is one whole sequence; another algorithm or an unknown option is refused."""
    packing = ["actor_train.use_sequence_packing=true",
               "+actor_train.sequence_packing_args={algorithm: load_balance, max_packed_sequence_length_train: 4096, "
               "min_num_micro_batches_train: 2}"]
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = load_roll(GSPO, packing)
    role = cfg.actor_train
    assert role.use_dynamic_batching_in_train and role.max_tokens_per_microbatch_in_train == 4096
    assert role.use_dynamic_batching_in_infer and role.max_tokens_per_microbatch_in_infer == cfg.max_sequence_tokens()
    assert caplog.text.count("actor_train.use_sequence_packing: token-budget micro-batches") == 1
    assert "min_num_micro_batches_train (Megatron pipeline stages to fill) ignored" in caplog.text
    message = refusal(GSPO, ["actor_train.use_sequence_packing=true",
                             "+actor_train.sequence_packing_args={algorithm: first_fit, max_packed_len: 9}"])
    assert "algorithm = 'first_fit': one of none, load_balance" in message
    assert "unknown option(s) max_packed_len" in message
    clash = refusal(GSPO, [*packing, "actor_train.max_tokens_per_microbatch_in_train=8192"])
    assert "max_packed_sequence_length_train = 4096 sets actor_train.max_tokens_per_microbatch_in_train" in clash


def test_async_generation_needs_the_rollout_engines_log_probs(in_roll_dir):
    message = refusal(GSPO, ["async_generation_ratio=1", "old_logprob_source=trainer"])
    assert "async_generation_ratio: 1 needs the rollout engine's old log-probs" in message


def test_never_read_roll_keys(in_roll_dir, caplog):
    # num_train_epochs: ROLL ignores it in RLVR too; accepted with a notice (not refused).
    with caplog.at_level(logging.WARNING):
        load_roll(GSPO)
    assert "notice: actor_train.training_args.num_train_epochs = 50 is ignored in an rlvr run" in caplog.text
    # ROLL's `template` on the rollout and reference roles repeats the training one: accepted;
    # a different one is refused as never read.
    assert "template" not in caplog.text
    message = refusal(GSPO, ["actor_infer.data_args.template=chatml"])
    assert "actor_infer.data_args.template = 'chatml' is never read" in message


def test_gpu_only_values_on_cpu_are_adapted_with_one_notice_each(in_roll_dir, caplog):
    # The roles run on CPUs (cpu_overrides drop the mappings): what runs there replaces each GPU value.
    with caplog.at_level(logging.WARNING):
        cfg = load_roll(GSPO, ["actor_train.model_args.attn_implementation=fa2",
                               "reference.model_args.attn_implementation=fa2",
                               "actor_infer.strategy_args.strategy_config.block_size=16"])
    assert cfg.actor_train.model_args.attn_implementation == cfg.reference.model_args.attn_implementation == "sdpa"
    assert cfg.actor_infer.strategy_args.strategy_config["block_size"] == 32
    notices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("notice: on CPU, ")]
    assert ("notice: on CPU, attn_implementation: flash_attention_2 (ROLL's fa2) -> sdpa (FlashAttention needs a "
            "CUDA GPU); keys: actor_train.model_args.attn_implementation, reference.model_args.attn_implementation"
            ) in notices
    assert sum("vLLM block_size: 16 -> 32" in n for n in notices) == 1 and len(notices) == 3, notices
    assert any(n.startswith("notice: on CPU, vLLM gpu_memory_utilization: 0.8 -> not read") for n in notices)


def test_hydra_block_only_keys_with_meaning_here(tmp_path, in_roll_dir):
    text = ZERO3_SP2.read_text().replace("  output_subdir: null", "  output_subdir: .hydra\n  job:\n    chdir: true")
    path = ROLL_DIR / "_tmp_hydra_test.yaml"
    path.write_text(text)
    try:
        message = refusal(path, [])
    finally:
        path.unlink()
    assert "hydra.output_subdir = '.hydra' is refused" in message
    assert "hydra.job.chdir = True is refused" in message
    # A misspelt Hydra key is Hydra's own error.
    assert "hydra.run.dirr" not in roll_compat.hydra_block_problems({"run": {"dir": "."}})


def test_contradictions_between_roll_and_project_names(in_roll_dir):
    assert "(ROLL's name for save_total_limit) contradicts save_total_limit" in refusal(
        GSPO, ["+max_ckpt_to_keep=3", "save_total_limit=2"])
    assert "keep one family of keys" in refusal(GSPO, ["norm_mean_type=group", "norm_std_type=group",
                                                        "reward_shift=true"])
    assert "different statistics for mean and std" in refusal(GSPO, ["norm_mean_type=group", "norm_std_type=batch"])
    assert "pg_clip_low also written" in refusal(GSPO, ["pg_clip=0.2", "pg_clip_low=0.1"])
    assert "remove pg_clip" in refusal(GSPO, ["pg_clip=0.2", "use_pg_clip_range=true"])
    assert "global_template = 'chatml' contradicts actor_train.data_args.template" in refusal(
        GSPO, ["global_template=chatml"])


def test_unbuilt_roll_reward_worker_fails_dry_run_naming_available(in_roll_dir):
    cfg = load_roll(GSPO, ["+rewards.general={worker_cls: roll.pipeline.rlvr.rewards."
                           "general_val_rule_reward_worker.GeneralValRuleRewardWorker, tag_included: [general]}"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "GeneralValRuleRewardWorker' (known to ROLL, not built here yet)" in message
    assert "roll_gspo.workers.rewards.MathRuleRewardWorker" in message and "RegexMatchRewardWorker" in message


def test_reward_worker_table_is_one_line_per_worker():
    path = "roll.pipeline.rlvr.rewards.detection_reward_worker.DetectionRewardWorker"
    assert roll_compat.reward_worker_problem("judge", path)
    roll_compat.ROLL_REWARD_WORKERS[path] = "roll_gspo.workers.rewards.RegexMatchRewardWorker"
    try:
        assert roll_compat.map_reward_worker(path) == "roll_gspo.workers.rewards.RegexMatchRewardWorker"
        assert path in roll_compat.available_reward_workers()
    finally:
        roll_compat.ROLL_REWARD_WORKERS[path] = None


# --------------------------------------------------------------------------------------------
# Accepted keys act
# --------------------------------------------------------------------------------------------
def test_roll_aliases_and_mappings_act(in_roll_dir):
    cfg = load_roll(GSPO, ["+max_ckpt_to_keep=0", "+pg_clip=0.1", "norm_mean_type=batch", "~reward_norm",
                           "~reward_shift", "~reward_scale", "actor_train.data_args.messages=msgs",
                           "+actor_train.data_args.tag=source", "+global_template=qwen2_5"])
    assert cfg.save_total_limit == 0                            # keep all
    assert cfg.pg_clip_low == cfg.pg_clip_high == 0.1
    assert (cfg.reward_norm, cfg.reward_shift, cfg.reward_scale) == ("batch", True, False)
    assert cfg.actor_train.data_args.messages_key == "msgs" and cfg.actor_train.data_args.tag_key == "source"
    for mean, std, expected in [("group", "group", ("group", False, False)), (None, "running", ("running", False, True))]:
        over = ["~reward_norm", "~reward_shift", "~reward_scale", f"norm_mean_type={mean or 'null'}",
                f"norm_std_type={std}"]
        c = load_roll(GSPO, over)
        assert (c.reward_norm, c.reward_shift, c.reward_scale) == expected


def test_deepspeed_auto_entries_filled(in_roll_dir):
    from roll_gspo.strategies.deepspeed_strategy import build_deepspeed_config

    cfg = load_roll(ZERO3_SP2, ["actor_train.model_args.dtype=fp32"])
    ds = build_deepspeed_config(cfg.actor_train, world_size=2, hidden_size=128)
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["train_batch_size"] == 8
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == 128 * 128 and zero["stage3_param_persistence_threshold"] == 1280
    offload = build_deepspeed_config(load_roll(GSPO).actor_train, world_size=1, hidden_size=128)
    assert offload["zero_force_ds_cpu_optimizer"] is False


def test_chat_templates_apply_to_messages_and_prompt_rows(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from roll_gspo.data.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"messages": json.dumps([{"role": "user", "content": "1+1="}]), "tag": "t", "ground_truth": "2"},
            {"prompt": "2+2=", "tag": "t", "ground_truth": "4"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, _ = load_prompts([str(path)], default_domain="d", tokenizer=tokenizer, max_prompt_length=256,
                            template="qwen2_5")
    for item, content in zip(items, ("1+1=", "2+2=")):
        assert item["prompt_text"] == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                                       f"helpful assistant.<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n"
                                       "<|im_start|>assistant\n")
        assert item["domain"] == "t"                           # the `tag` column routes the row
    native, _ = load_prompts([str(path)], default_domain="d", tokenizer=tokenizer, max_prompt_length=256,
                             template="native")
    assert native[1]["prompt_text"] == "2+2="                 # the tiny tokenizer's own template
    plain, _ = load_prompts([str(path)], default_domain="d", tokenizer=tokenizer, max_prompt_length=256)
    assert plain[1]["prompt_text"] == "2+2=" and plain[0]["prompt_text"] == "1+1="


def test_dataset_dir_and_preprocessing_workers_act(tiny_model, tmp_path, monkeypatch):
    import datasets
    from transformers import AutoTokenizer

    from roll_gspo.data.prompts import load_prompts

    (tmp_path / "d").mkdir()
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(8)]
    (tmp_path / "d" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    calls = []
    real_map = datasets.Dataset.map
    monkeypatch.setattr(datasets.Dataset, "map", lambda self, *a, **k: calls.append(k.get("num_proc")) or real_map(self, *a, **k))
    items, _ = load_prompts(["rows.jsonl"], default_domain="d", tokenizer=tokenizer, max_prompt_length=64,
                            dataset_dir="d", num_proc=2)
    serial, _ = load_prompts(["d/rows.jsonl"], default_domain="d", tokenizer=tokenizer, max_prompt_length=64)
    assert [i["prompt_ids"] for i in items] == [i["prompt_ids"] for i in serial]
    assert calls == [2]
    with pytest.raises(ValueError, match="neither under dataset_dir"):
        load_prompts(["missing.jsonl"], default_domain="d", tokenizer=tokenizer, max_prompt_length=64, dataset_dir="d")


def test_difficulty_loss_weight_needs_the_column(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from roll_gspo.data.prompts import load_prompts

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(ValueError, match="difficulty_loss_weight reads `difficulty`"):
        load_prompts([str(path)], default_domain="d", tokenizer=tokenizer, max_prompt_length=64,
                     require_columns=("difficulty",))


def test_sample_masks_and_weights():
    from roll_gspo.algorithms.sample_weights import sample_loss_weights

    scores = torch.tensor([1., 1., 1., 1., 0., 1., 0., 0.5])     # group 0 all solved, group 1 mixed
    lengths = torch.tensor([3, 4, 5, 6, 7, 8, 20, 2])
    truncated = torch.tensor([False, False, False, False, False, True, False, False])
    w, m = sample_loss_weights(scores, lengths, truncated, 4, difficulty_mask=True, difficulty_low=0.1,
                               difficulty_high=0.95)
    assert w.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and m["actor/difficulty_mask_ratio"] == 0.5
    w, _ = sample_loss_weights(scores, lengths, truncated, 4, max_len_mask=True)
    assert w[5] == 0 and w.sum() == 7
    w, _ = sample_loss_weights(scores, lengths, truncated, 4, error_max_len_clip=True, error_max_len_threshold=10)
    assert w.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]             # long wrong answer and partial score out
    w, _ = sample_loss_weights(scores, lengths, truncated, 4, length_loss_weight=True)
    assert w.mean().item() == pytest.approx(1.0) and w[7] > w[0] > w[6]
    w, _ = sample_loss_weights(scores, lengths, truncated, 4, difficulty=torch.tensor([0., 1.] * 4))
    assert w[1] / w[0] == pytest.approx(4.0)                 # (0.5 + 1.5) / 0.5


def test_system_envs_reach_every_worker(ray_session):
    import ray

    from roll_gspo.distributed.cluster import Cluster, RankWorker, worker_env

    class EnvProbe(RankWorker):
        def read(self, name):
            return os.environ.get(name)

    cfg = PipelineConfig(system_envs={"ROLL_TEST_A": "1", "ROLL_TEST_B": "top"})
    cfg.actor_train.system_envs = {"ROLL_TEST_B": "role"}
    cluster = Cluster("env_probe", EnvProbe, 1, 0.1, 0, env=worker_env(cfg, cfg.actor_train))
    try:
        assert ray.get(cluster.workers[0].read.remote("ROLL_TEST_A")) == "1"
        assert ray.get(cluster.workers[0].read.remote("ROLL_TEST_B")) == "role"
    finally:
        cluster.shutdown()


def test_entropy_bonus_enters_the_loss(tiny_model):
    """The entropy term changes the gradient: with a bonus, a step moves the weights differently."""
    from roll_gspo.algorithms import aggregate_loss
    from roll_gspo.models.causal_lm import load_causal_lm, response_token_log_probs

    model = load_causal_lm(tiny_model)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = response_token_log_probs(model, ids, torch.ones_like(ids), torch.tensor([2]), 3, 1.0,
                                   with_entropy=True, entropy_grad=True)
    entropy = out[1]
    assert entropy.requires_grad
    bonus = aggregate_loss(entropy, torch.ones(1, 3), "seq-mean-token-mean")
    bonus.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# --------------------------------------------------------------------------------------------
# The ROLL files train for 2 steps on CPU
# --------------------------------------------------------------------------------------------
def _run(path, tmp_path, monkeypatch, extra=()):
    from tests.test_roll_recipes import run_recipe

    assert run_recipe(["--config", path.name, *cpu_overrides(path, tmp_path), "actor_train.num_cpus_per_worker=0.5",
                       "actor_infer.num_cpus_per_worker=0.5", *extra], monkeypatch) == 0
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_zero3_sp2_trains_two_steps_on_cpu(tmp_path, session_cache, ray_session, monkeypatch):
    metrics = _run(ZERO3_SP2, tmp_path, monkeypatch)
    assert [m["step"] for m in metrics][-2:] == [1, 2]
    steps = [m for m in metrics if m["step"] > 0]
    assert all("actor/difficulty_mask_ratio" in m and "actor/max_len_mask_ratio" in m for m in steps)
    # A random model solves nothing, so difficulty_mask leaves every response out: no gradient.
    for m in steps:
        if m["actor/samples_used"] == 0:
            assert m["actor/grad_norm"] == 0
    assert (tmp_path / "ckpt" / "checkpoints" / "step_2" / "COMPLETE").exists()   # checkpoint_config.output_dir
    assert list((tmp_path / "tb").glob("events.*"))                              # tracker_kwargs.log_dir


@pytest.mark.e2e
def test_gspo_example_trains_two_steps_with_zero3_cpu_offload(tmp_path, session_cache, ray_session, monkeypatch):
    metrics = _run(GSPO, tmp_path, monkeypatch, ["+entropy_loss_coef=0.01"])
    steps = [m for m in metrics if m["step"] > 0]
    assert len(steps) == 2 and all("actor/kl_loss" in m and "actor/entropy_loss" in m for m in steps)


def test_max_ckpt_to_keep_zero_keeps_every_checkpoint(tmp_path):
    from roll_gspo.lifecycle.checkpoint import begin_checkpoint, commit_checkpoint, complete_checkpoints

    out = str(tmp_path)
    for step in (1, 2, 3):
        commit_checkpoint(begin_checkpoint(out, step), {"step": step}, out, step, keep=0)
    assert len(complete_checkpoints(out)) == 3
    commit_checkpoint(begin_checkpoint(out, 4), {"step": 4}, out, 4, keep=2)
    assert len(complete_checkpoints(str(tmp_path))) == 2


def test_frozen_engine_runs_zero2_presets_as_stage_0():
    from roll_gspo.strategies.deepspeed_strategy import frozen_engine_config

    zero2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    assert frozen_engine_config(zero2)["zero_optimization"] == {"stage": 0}
    assert frozen_engine_config({"zero_optimization": {"stage": 3}})["zero_optimization"]["stage"] == 3


def test_hydra_searchpath_acts_and_misspelt_hydra_keys_fail(tmp_path):
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "my_zero.yaml").write_text("_my_zero:\n  zero_optimization:\n    stage: 1\n")
    (tmp_path / "run.yaml").write_text(
        "defaults:\n  - my_zero@_here_\n  - deepspeed_zero2@_here_\n"
        f"hydra:\n  searchpath:\n    - file://{presets}\n"
        "_ds: ${_my_zero}\n"
        "actor_train:\n  data_args:\n    file_name: [builtin:arith/train]\n"
        "  strategy_args:\n    strategy_config: ${_ds}\n"
        "rollout_batch_size: 8\nnum_return_sequences_in_group: 8\n")
    cfg = load_config(str(tmp_path / "run.yaml"))
    assert cfg.actor_train.strategy_args.strategy_config["zero_optimization"]["stage"] == 1
    (tmp_path / "bad.yaml").write_text("hydra:\n  run:\n    dirr: .\nmax_steps: 1\n")
    with pytest.raises(ConfigError, match="dirr"):
        load_config(str(tmp_path / "bad.yaml"))
