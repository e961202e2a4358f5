"""Strict loading of a config (roll_gspo.config): ROLL's GSPO seed block read and typed, unknown keys
named with a suggestion, wrong types and choices, spellings and defaults, finding a config by
name. Fast: no Ray, no model loading."""
import typing

import pytest
import yaml

from roll_gspo.config import ConfigError, load_config, preflight, resolve_config_path
from roll_gspo.schema.config import PipelineConfig
from tests.config_helpers import BASE, EXAMPLE, FITS_BUILTIN_MODEL, SEED_004, SEED_KEYS, load, problems, with_line


# --------------------------------------------------------------------------------------------
# The seed configuration
# --------------------------------------------------------------------------------------------
def test_every_seed_004_key_is_accepted_and_typed(tmp_path):
    seed = yaml.safe_load(SEED_004)
    assert sorted(seed) == sorted(SEED_KEYS)
    cfg = load(tmp_path)
    defaults = PipelineConfig()
    hints = typing.get_type_hints(PipelineConfig)
    for key, value in seed.items():
        got = getattr(cfg, key)
        assert got == value, key
        if value is None:
            assert got is None, key
            continue
        declared = [t for t in typing.get_args(hints[key]) if t is not type(None)] or [hints[key]]
        assert type(got) is declared[0], (key, got, declared)  # e.g. `reward_clip: 10` -> 10.0
    # Values the loader must not leave at a default nor silently drop (ROLL drops reward_norm & co).
    assert cfg.adv_estimator == "reinforce" != defaults.adv_estimator
    assert cfg.loss_agg_mode == "seq-mean-token-sum" != defaults.loss_agg_mode
    assert cfg.reward_norm is None
    assert cfg.reward_clip == 10.0 and type(cfg.reward_clip) is float
    assert cfg.advantage_clip == 2.0 and type(cfg.advantage_clip) is float
    assert cfg.kl_loss_coef == 0.001 and type(cfg.kl_loss_coef) is float
    assert cfg.use_kl_loss is True and cfg.whiten_advantages is True and cfg.dual_clip_loss is True
    assert cfg.reward_shift is False and cfg.reward_scale is False and cfg.add_token_level_kl is False
    assert (cfg.rollout_batch_size, cfg.num_return_sequences_in_group) == (64, 8)
    assert (cfg.prompt_length, cfg.response_length, cfg.ppo_epochs) == (2048, 4096, 1)
    # Derived values and helpers.
    assert cfg.mini_batch_size() == 64
    assert cfg.needs_reference()  # use_kl_loss: true
    assert cfg.actor_infer.generating_args.num_return_sequences == 8
    assert cfg.actor_infer.generating_args.max_new_tokens == 4096
    assert cfg.actor_train.model_args.model_name_or_path == cfg.pretrain
    assert cfg.actor_train.data_args.file_name == ["builtin:arith/train"]


def test_seed_config_passes_preflight(tmp_path):
    cfg = load(tmp_path, BASE + "actor_infer:\n  strategy_args:\n    strategy_name: hf_infer\n",
               overrides=FITS_BUILTIN_MODEL)
    preflight(cfg)  # built-in data set and model names are known


def test_scalar_file_name_means_a_list_of_one(tmp_path):
    cfg = load(tmp_path, overrides=["actor_train.data_args.file_name=builtin:arith/train"])
    assert cfg.actor_train.data_args.file_name == ["builtin:arith/train"]


# --------------------------------------------------------------------------------------------
# Unknown keys
# --------------------------------------------------------------------------------------------
def test_misspelled_top_level_key(tmp_path):
    message = problems(tmp_path, BASE + "rollout_batch_sise: 32\n")
    assert "unknown key 'rollout_batch_sise'" in message
    assert "did you mean 'rollout_batch_size'" in message


def test_misspelled_nested_key_names_full_paths(tmp_path):
    text = BASE.replace("    gradient_accumulation_steps: 8\n",
                        "    gradient_accumulation_steps: 8\n    learnig_rate: 1.0e-5\n")
    message = problems(tmp_path, text)
    assert "unknown key 'actor_train.training_args.learnig_rate'" in message
    assert "did you mean 'actor_train.training_args.learning_rate'" in message


@pytest.mark.parametrize("override, wrong, right", [
    ("actor_train.training_args.learnig_rate=1e-5", "actor_train.training_args.learnig_rate",
     "actor_train.training_args.learning_rate"),
    ("ppo_epoch=2", "ppo_epoch", "ppo_epochs"),
    ("rewards.math_rule.worker_clss=x.Y", "rewards.math_rule.worker_clss", "rewards.math_rule.worker_cls"),
    ("validation.generating_args.temprature=0.5", "validation.generating_args.temprature",
     "validation.generating_args.temperature"),
])
def test_misspelled_key_in_override(tmp_path, override, wrong, right):
    message = problems(tmp_path, overrides=[override])
    assert f"unknown key {wrong!r}" in message
    assert f"did you mean {right!r}" in message


def test_key_at_the_wrong_level_points_to_its_place(tmp_path):
    message = problems(tmp_path, BASE + "learning_rate: 1.0e-5\n")
    assert "unknown key 'learning_rate'" in message
    assert "'actor_train.training_args.learning_rate'" in message


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    message = problems(tmp_path, BASE + "actor_infer:\n  model_args:\n    zzz: 1\n")
    assert "unknown key 'actor_infer.model_args.zzz'" in message
    assert "valid keys here:" in message and "model_name_or_path" in message


# --------------------------------------------------------------------------------------------
# Types and choices
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("yaml_text, expected", [
    ("rollout_batch_size: abc\n", "rollout_batch_size: expected int, got str 'abc'"),
    ("rollout_batch_size: 64.5\n", "rollout_batch_size: expected int, got float"),
    ("use_kl_loss: 3\n", "use_kl_loss: expected bool, got int"),
    ("reward_clip: high\n", "reward_clip: expected float or null, got str 'high'"),
    ("prompt_length: null\n", "prompt_length: null is not allowed (expected int)"),
    ("validation:\n  data_args:\n    file_name: 3\n", "validation.data_args.file_name: expected a list"),
    ("actor_infer:\n  strategy_args: vllm\n", "actor_infer.strategy_args: expected a mapping"),
])
def test_wrong_type_names_expected_type(tmp_path, yaml_text, expected):
    assert expected in problems(tmp_path, with_line(BASE, yaml_text))


def test_wrong_nested_type_in_override(tmp_path):
    message = problems(tmp_path, overrides=["actor_train.training_args.learning_rate=fast"])
    assert "actor_train.training_args.learning_rate: expected float, got str 'fast'" in message


@pytest.mark.parametrize("key, bad, valid", [
    ("loss_agg_mode", "seq-mean",
     ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    ("importance_sampling", "sequence", ["seq", "token", "gspo-token"]),
    ("adv_estimator", "ppo", ["reinforce", "grpo", "rloo"]),
    ("reward_norm", "none", ["group", "batch", "running"]),
    ("kl_estimator", "k4", ["k1", "k2", "k3"]),
    ("actor_infer.strategy_args.strategy_name", "megatron", ["deepspeed_train", "vllm", "hf_infer"]),
])
def test_invalid_choice_lists_valid_values(tmp_path, key, bad, valid):
    message = problems(tmp_path, overrides=[f"{key}={bad}"])
    assert f"{key}: invalid value {bad!r}; valid values:" in message
    listed = message.split("valid values:", 1)[1].splitlines()[0]
    for value in valid:
        assert repr(value) in listed
    if key == "reward_norm":
        assert "null" in listed


def test_valid_choices_are_accepted(tmp_path):
    cfg = load(tmp_path, overrides=["loss_agg_mode=seq-mean-token-sum-norm", "importance_sampling=gspo-token",
                                    "adv_estimator=rloo", "reward_norm=running", "kl_estimator=k1"])
    assert (cfg.loss_agg_mode, cfg.importance_sampling, cfg.adv_estimator, cfg.reward_norm,
            cfg.kl_estimator) == ("seq-mean-token-sum-norm", "gspo-token", "rloo", "running", "k1")


def test_multiple_problems_are_reported_at_once(tmp_path):
    text = BASE + "ppo_epoch: 2\nkl_estimator: k9\nseed: abc\n"
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, ["actor_train.training_args.learnig_rate=1e-5"])
    found = info.value.problems
    assert len(found) == 4, found
    message = str(info.value)
    for part in ("ppo_epoch", "k9", "seed: expected int", "learnig_rate"):
        assert part in message


# --------------------------------------------------------------------------------------------
# Defaults and spellings: null, resume_from_checkpoint, system_envs
# --------------------------------------------------------------------------------------------
def test_null_means_the_default_and_zero_is_not_null(tmp_path):
    cfg = load(tmp_path)
    assert (cfg.actor_infer.generating_args.max_new_tokens, cfg.loss_norm_length) == (4096, 4096)
    assert cfg.validation.generating_args.num_return_sequences == 1


@pytest.mark.parametrize("value, expected", [
    ("true", "auto"), ("false", None), ("auto", "auto"), ("null", None), ("/ckpt/step_10", "/ckpt/step_10"),
])
def test_resume_from_checkpoint_spellings(tmp_path, value, expected):
    assert load(tmp_path, BASE + f"resume_from_checkpoint: {value}\n").resume_from_checkpoint == expected


def test_resume_from_checkpoint_bool_override(tmp_path):
    assert load(tmp_path, overrides=["resume_from_checkpoint=true"]).resume_from_checkpoint == "auto"
    assert load(tmp_path, overrides=["resume_from_checkpoint=false"]).resume_from_checkpoint is None


def test_system_envs_take_yaml_integers_as_strings_and_refuse_booleans():
    """`OMP_NUM_THREADS: 2` is what users write (YAML reads an int; Ray's env_vars want strings)."""
    cfg = load_config("example_gspo.yaml", ["+system_envs.MALLOC_ARENA_MAX=2", "actor_infer.system_envs.OMP_NUM_THREADS=1"])
    assert cfg.system_envs["MALLOC_ARENA_MAX"] == "2" and cfg.actor_infer.system_envs["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ConfigError, match=r"system_envs.VERBOSE: expected str, got bool True"):
        load_config("example_gspo.yaml", ["+system_envs.VERBOSE=true"])


# --------------------------------------------------------------------------------------------
# Finding configs
# --------------------------------------------------------------------------------------------
def test_config_name_resolves_with_and_without_extension():
    assert resolve_config_path("example_gspo.yaml") == EXAMPLE
    assert resolve_config_path("example_gspo") == EXAMPLE
    assert resolve_config_path(str(EXAMPLE)) == EXAMPLE
    cfg = load_config("example_gspo")
    assert cfg.exp_name == "example_gspo" and cfg.importance_sampling == "seq"


def test_missing_config_name_raises_with_hint():
    with pytest.raises(FileNotFoundError, match="example_gspoo.*did you mean 'example_gspo.yaml'"):
        resolve_config_path("example_gspoo")
