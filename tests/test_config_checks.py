"""The checks beyond types (roll_gspo.config.checks): contradictions and batch arithmetic, keys
whose values cannot work, keys a role never reads, the warnings about GSPO traps and stale or
many optimizer steps, and the vLLM engine keys refused on the CPU. Fast: no Ray, no model loading."""
import dataclasses
import typing

import pytest

from roll_gspo.config import ConfigError, load_config, validate_config
from roll_gspo.schema.config import PipelineConfig
from tests.config_helpers import EXAMPLE, SEED_004, load, problems, schema_fields, warning_messages
from tests.config_helpers import config_log  # noqa: F401  (the fixture)


# --------------------------------------------------------------------------------------------
# Contradictions and batch arithmetic
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["reward_norm=group", "reward_shift=true", "reward_scale=true"], "reward_shift and reward_scale are both true"),
    (["rollout_batch_size=63"], "504 responses per step is not divisible by the mini-batch"),
    (["actor_train.training_args.per_device_train_batch_size=5"], "is not divisible"),
    (["adv_estimator=grpo", "num_return_sequences_in_group=1"], "'grpo' needs num_return_sequences_in_group >= 2"),
    (["adv_estimator=rloo", "num_return_sequences_in_group=1"], "'rloo' needs num_return_sequences_in_group >= 2"),
    (["dual_clip_c=1.0"], "dual_clip_c: must be > 1"),
    (["dual_clip_c=0.5"], "dual_clip_c: must be > 1"),
    (["actor_infer.generating_args.num_return_sequences=4"], "contradicts num_return_sequences_in_group = 8"),
])
def test_contradictions_fail(tmp_path, overrides, expected):
    assert expected in problems(tmp_path, overrides=overrides)


@pytest.mark.parametrize("overrides", [
    ["reward_norm=group", "reward_shift=true"],                       # one of the two is fine
    ["rollout_batch_size=72"],                                        # 576 = 9 * 64
    ["adv_estimator=grpo", "num_return_sequences_in_group=2",         # 128 = 2 * 64
     "rollout_batch_size=64"],
    ["adv_estimator=reinforce", "num_return_sequences_in_group=1"],   # no group baseline needed
    ["dual_clip_loss=false", "dual_clip_c=1.0"],                      # c unused without dual clip
    ["actor_infer.generating_args.num_return_sequences=8"],           # agrees with the group size
    ["eval_steps=5", "validation.data_args.file_name=[builtin:arith/val]"],
])
def test_consistent_neighbours_of_the_contradictions_load(tmp_path, overrides):
    load(tmp_path, overrides=overrides)


def test_semantic_problems_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, overrides=["reward_norm=group", "reward_shift=true", "reward_scale=true",
                                  "rollout_batch_size=63", "dual_clip_c=1.0"])
    assert len(info.value.problems) == 3, info.value.problems


# --------------------------------------------------------------------------------------------
# Values that cannot work (config holes)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["kl_loss_coef=-0.001"], "kl_loss_coef: must be >= 0"),
    (["init_kl_coef=-0.2"], "init_kl_coef: must be >= 0"),
    (["actor_train.training_args.learning_rate=-1e-6"], "actor_train.training_args.learning_rate: must be >= 0"),
    (["actor_train.training_args.warmup_steps=-1"], "actor_train.training_args.warmup_steps: must be >= 0"),
    (["actor_train.training_args.max_grad_norm=-1.0"], "actor_train.training_args.max_grad_norm: must be >= 0"),
    (["weight_sync_bucket_mb=-1"], "weight_sync_bucket_mb: must be > 0"),
    (["actor_infer.generating_args.temperature=-0.5"], "actor_infer.generating_args.temperature: must be >= 0"),
    (["actor_infer.generating_args.top_p=0"], "actor_infer.generating_args.top_p: must be in (0, 1]"),
    (["actor_infer.generating_args.top_p=1.5"], "actor_infer.generating_args.top_p: must be in (0, 1]"),
    (["validation.generating_args.top_p=0"], "validation.generating_args.top_p: must be in (0, 1]"),
    (["actor_infer.generating_args.max_new_tokens=0"], "actor_infer.generating_args.max_new_tokens: must be >= 1"),
    (["validation.generating_args.max_new_tokens=0"], "validation.generating_args.max_new_tokens: must be >= 1"),
    (["actor_infer.generating_args.num_return_sequences=0"], "num_return_sequences: must be >= 1"),
    (["validation.generating_args.num_return_sequences=0"], "num_return_sequences: must be >= 1"),
    (["loss_norm_length=0"], "loss_norm_length: must be >= 1"),
    (["reward_norm=group", "num_return_sequences_in_group=1"], "turns every reward into 0"),
    (["+actor_infer.strategy_args.strategy_config.max_model_len=4096"],
     "max_model_len = 4096 is less than prompt_length + response_length = 2048 + 4096 = 6144"),
    (["+actor_train.strategy_args.strategy_config.bf16.enabled=true"],
     "actor_train.strategy_args.strategy_config.bf16.enabled = True contradicts actor_train.model_args.dtype = fp32"),
    (["actor_train.model_args.dtype=bf16", "+actor_train.strategy_args.strategy_config.bf16.enabled=false"],
     "bf16.enabled = False contradicts actor_train.model_args.dtype = bf16"),
    (["+reference.strategy_args.strategy_config.fp16.enabled=true"],
     "reference.strategy_args.strategy_config.fp16.enabled = True contradicts reference.model_args.dtype = fp32"),
    (["+actor_infer.strategy_args.strategy_config.dtype=bfloat16"],
     "strategy_config.dtype = 'bfloat16' contradicts actor_infer.model_args.dtype = 'fp32'"),
    (["actor_infer.model_args.model_name_or_path=/models/other"], "they must be the same policy"),
    (["+actor_infer.strategy_args.strategy_config.model=/models/other"], "drop the engine's model"),
])
def test_config_holes_are_refused(tmp_path, overrides, expected):
    assert expected in problems(tmp_path, overrides=overrides)


@pytest.mark.parametrize("overrides", [
    ["actor_infer.generating_args.temperature=0", "actor_infer.generating_args.top_p=1.0"],
    ["actor_train.training_args.max_grad_norm=0", "actor_train.training_args.learning_rate=0"],
    ["loss_norm_length=512", "actor_infer.generating_args.max_new_tokens=4096"],
    ["reward_norm=group", "num_return_sequences_in_group=2"],
    ["+actor_infer.strategy_args.strategy_config.max_model_len=6144",
     "+actor_infer.strategy_args.strategy_config.dtype=float32"],
    ["+actor_train.strategy_args.strategy_config.bf16.enabled=false",
     "+actor_train.strategy_args.strategy_config.fp16.enabled=auto"],
    ["actor_train.model_args.model_name_or_path=builtin:tiny-arith",
     "actor_infer.model_args.model_name_or_path=builtin:tiny-arith"],
])
def test_neighbours_of_the_config_holes_load(tmp_path, overrides):
    load(tmp_path, overrides=overrides)


# --------------------------------------------------------------------------------------------
# Keys a role never reads
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, acts_in", [
    ("actor_train.generating_args.temperature=0.7", "the setting that acts is actor_infer.generating_args"),
    ("reference.training_args.learning_rate=1e-5", "the setting that acts is none: the reference is frozen"),
    ("actor_infer.training_args.learning_rate=1e-5", "the setting that acts is actor_train.training_args"),
    ("actor_infer.data_args.file_name=[builtin:arith/train]", "the setting that acts is actor_train.data_args"),
    ("reference.generating_args.temperature=0.5", "the setting that acts is actor_infer.generating_args"),
    ("reference.model_args.gradient_checkpointing=true", "the setting that acts is actor_train.model_args.gradient_checkpointing"),
])
def test_keys_a_role_never_reads_are_refused_with_where_they_act(tmp_path, override, acts_in):
    key = override.split("=")[0]
    message = problems(tmp_path, overrides=[override])
    assert f"{key} = " in message and "is never read" in message and acts_in in message, message


def test_eval_steps_without_validation_prompts_is_a_notice(tmp_path, caplog):
    """ROLL's judge recipe sets eval_steps and no validation block: ROLL skips validation, so
    does this run (eval_steps becomes 0), saying so once."""
    import logging

    with caplog.at_level(logging.WARNING):
        cfg = load(tmp_path, overrides=["eval_steps=5"])
    assert cfg.eval_steps == 0
    assert "notice: eval_steps = 5 is ignored: validation.data_args.file_name is empty" in caplog.text


def test_keys_roll_ignores_in_rlvr_are_accepted_with_one_notice(tmp_path, caplog):
    """ROLL's recipes set num_train_epochs, which ROLL itself ignores in RLVR: refusing it failed
    every ROLL file for nothing. It loads, and one notice names what acts instead."""
    import logging

    with caplog.at_level(logging.WARNING):
        cfg = load(tmp_path, overrides=["actor_train.training_args.num_train_epochs=50"])
    assert cfg.actor_train.training_args.num_train_epochs == 50
    notices = [r.getMessage() for r in caplog.records if "num_train_epochs" in r.getMessage()]
    assert notices == ["notice: actor_train.training_args.num_train_epochs = 50 is ignored in an rlvr run, as in "
                       "ROLL; what acts is max_steps (an rlvr run is max_steps rollout batches, in ROLL too; "
                       "num_train_epochs is read by the sft pipeline)"]


def test_unread_keys_at_their_default_and_built_configs_are_judged_by_value(tmp_path):
    load(tmp_path, overrides=["actor_train.generating_args.temperature=1.0"])  # the default: no effect
    cfg = PipelineConfig()
    cfg.actor_train.data_args.file_name = ["builtin:arith/train"]
    cfg.actor_train.training_args.gradient_accumulation_steps = 8
    cfg.reference.training_args.learning_rate = 1e-3
    with pytest.raises(ConfigError, match="reference.training_args.learning_rate = 0.001 is never read"):
        validate_config(cfg)


def test_every_role_block_is_classified_in_the_reads_table():
    from roll_gspo.config.checks.role_reads import ROLE_BLOCKS, UNREAD_KEYS
    from roll_gspo.schema.config import RoleConfig

    hints = typing.get_type_hints(RoleConfig)
    blocks = {f.name for f in dataclasses.fields(RoleConfig) if dataclasses.is_dataclass(hints[f.name])}
    for role, table in ROLE_BLOCKS.items():
        assert set(table) == blocks, (role, blocks ^ set(table))
    paths = {p for p, _ in schema_fields(PipelineConfig)}
    assert set(UNREAD_KEYS) <= paths


# --------------------------------------------------------------------------------------------
# Warnings (GSPO traps, stale rollouts, many optimizer steps, rollout threads)
# --------------------------------------------------------------------------------------------
def test_one_optimizer_step_per_rollout_warns(tmp_path, config_log):
    # 8 * 64 * 1 = 512 = the whole batch of 64 * 8: one mini-batch, one step.
    cfg = load(tmp_path, overrides=["actor_train.training_args.gradient_accumulation_steps=64"])
    assert any("one optimizer step per rollout" in m for m in warning_messages(config_log))
    assert any("one optimizer step per rollout" in w for w in validate_config(cfg))


def test_two_epochs_of_one_mini_batch_do_not_warn(tmp_path):
    cfg = load(tmp_path, overrides=["actor_train.training_args.gradient_accumulation_steps=64", "ppo_epochs=2"])
    assert not any("one optimizer step" in w for w in validate_config(cfg))


def test_seq_ratio_with_token_clip_warns(tmp_path, config_log):
    cfg = load(tmp_path, overrides=["pg_clip_low=0.2", "pg_clip_high=0.2"])
    assert any("token-sized clip range" in m for m in warning_messages(config_log))
    assert any("token-sized clip range" in w for w in validate_config(cfg))


def test_token_ratio_with_clip_02_does_not_warn_about_clip(tmp_path):
    cfg = load(tmp_path, overrides=["importance_sampling=token", "pg_clip_low=0.2", "pg_clip_high=0.27"])
    assert not any("clip range" in w for w in validate_config(cfg))


def test_paper_settings_do_not_warn(tmp_path, config_log):
    # GSPO paper: 4 mini-batches per rollout (512 / (8 * 16 * 1)), clip 3e-4 / 4e-4, no KL.
    cfg = load(tmp_path, overrides=["actor_train.training_args.gradient_accumulation_steps=16",
                                    "pg_clip_low=3e-4", "pg_clip_high=4e-4", "use_kl_loss=false"])
    assert cfg.rollout_batch_size * cfg.num_return_sequences_in_group // cfg.mini_batch_size() == 4
    assert validate_config(cfg) == []
    assert warning_messages(config_log) == []


def test_example_config_does_not_warn(config_log):
    cfg = load_config(str(EXAMPLE))
    assert validate_config(cfg) == []


def test_stale_rollouts_warn_and_explain_the_ratio(tmp_path, config_log):
    load(tmp_path, overrides=["model_update_frequency=3"])
    message = next(m for m in warning_messages(config_log) if "model_update_frequency = 3" in m)
    assert "off-policy" in message and "importance ratio measures" in message and "not the older weights" in message


def test_seed_004_with_default_batch_keys_warns_with_the_arithmetic(tmp_path, config_log):
    load(tmp_path, SEED_004 + "actor_train:\n  data_args:\n    file_name: [builtin:arith/train]\n")
    message = next(m for m in warning_messages(config_log) if "optimizer steps per rollout" in m)
    assert message.startswith("512 optimizer steps per rollout") and "1 * 64 * 8 / (1 * 1 * 1) = 512" in message
    assert "0.0003" in message and "mini-batch of 128" in message


def test_async_with_extra_rollout_threads_warns_and_the_example_does_not(tmp_path, config_log):
    load_config("example_gspo.yaml", ["async_generation_ratio=1"])
    message = next(m for m in warning_messages(config_log) if "OMP_NUM_THREADS" in m)
    assert "OMP_NUM_THREADS = 2 in actor_infer's system_envs" in message and "0.5 CPU" in message
    config_log.clear()
    load_config("example_gspo.yaml")  # synchronous: the trainer waits while vLLM generates
    assert not [m for m in warning_messages(config_log) if "OMP_NUM_THREADS" in m]


# --------------------------------------------------------------------------------------------
# vLLM engine keys
# --------------------------------------------------------------------------------------------
def test_a_foreign_vllm_worker_extension_is_refused_by_name():
    from roll_gspo.strategies.vllm_strategy import EXTENSION, WeightUpdateExtension, _check_extension

    _check_extension(EXTENSION)  # ours passes
    with pytest.raises(ValueError, match="worker_extension_cls='roll_gspo.rewards.math_verify_reward' must subclass"):
        _check_extension("roll_gspo.rewards.math_verify_reward")
    assert WeightUpdateExtension.__module__ + "." + WeightUpdateExtension.__qualname__ == EXTENSION


ENGINE = "actor_infer.strategy_args.strategy_config"


@pytest.mark.parametrize("overrides, expected", [
    ([f"+{ENGINE}.enable_chunked_prefill=true"], f"{ENGINE}.enable_chunked_prefill = true: a batch whose prompts"),
    ([f"+{ENGINE}.max_num_batched_tokens=4096"], f"{ENGINE}.max_num_batched_tokens = 4096 is less than "
                                                 f"max_model_len = 6144"),
    ([f"+{ENGINE}.long_prefill_token_threshold=512"], f"{ENGINE}.long_prefill_token_threshold = 512: vLLM cuts"),
])
def test_vllm_keys_that_would_split_a_prompt_on_cpu_are_refused(tmp_path, overrides, expected):
    """vLLM on CPU cannot split a prompt over steps under seeded sampling (vllm_prefill): keys
    that would are refused, naming themselves and the crash."""
    message = problems(tmp_path, overrides=overrides)
    assert expected in message and "CPU Generator does not use offset" in message, message


def test_vllm_budgets_that_keep_prompts_whole_on_cpu_are_accepted(tmp_path):
    load(tmp_path, overrides=[f"+{ENGINE}.max_num_batched_tokens=32768"])  # above max_model_len: none split
    load(tmp_path, overrides=[f"+{ENGINE}.enable_chunked_prefill=true", f"+{ENGINE}.max_num_seqs=2",
                              f"+{ENGINE}.max_num_batched_tokens=12288"])  # 2 x 6144: nothing ever split
