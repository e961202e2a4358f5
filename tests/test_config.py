"""Tests of roll_gspo.config: strict loading, Hydra grammar, validation, preflight, the CLI and
the generated reference. Fast: no Ray, no model loading (the two vLLM dry runs import vllm)."""
import dataclasses
import logging
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from roll_gspo.config import ConfigError, config_to_yaml, load_config, preflight, resolve_config_path, validate_config
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.load.config_reference import main as reference_main
from roll_gspo.config.load.config_reference import render_reference

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "example_gspo.yaml"

# ROLL's GSPO configuration block, verbatim from its doc page (seed 004).
SEED_004 = """\
# GSPO related
adv_estimator: "reinforce"
importance_sampling: seq
rollout_batch_size: 64 # prompt
num_return_sequences_in_group: 8
prompt_length: 2048
response_length: 4096
# ppo related
ppo_epochs: 1
use_kl_loss: true
kl_loss_coef: 0.001
loss_agg_mode: "seq-mean-token-sum"
# advantage
whiten_advantages: true
advantage_clip: 2.0
dual_clip_loss: true
# clip
reward_clip: 10
# normalize
reward_norm: null
reward_shift: false
reward_scale: false
# reward
add_token_level_kl: false
"""
SEED_KEYS = [
    "adv_estimator", "importance_sampling", "rollout_batch_size", "num_return_sequences_in_group",
    "prompt_length", "response_length", "ppo_epochs", "use_kl_loss", "kl_loss_coef",
    "loss_agg_mode", "whiten_advantages", "advantage_clip", "dual_clip_loss", "reward_clip",
    "reward_norm", "reward_shift", "reward_scale", "add_token_level_kl",
]
# The least the seed block needs besides itself: training prompts and a mini-batch that divides
# 64 * 8 = 512 responses (8 * 8 * 1 = 64: 8 optimizer steps per rollout).
MINIMAL = """\
actor_train:
  training_args:
    per_device_train_batch_size: 8
    gradient_accumulation_steps: 8
  data_args:
    file_name: [builtin:arith/train]
  world_size: 1
"""
BASE = SEED_004 + MINIMAL


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def with_line(text, line):
    """`text` with a top-level `key: value` line replacing the key's line, or appended."""
    key = line.split(":", 1)[0] + ":"
    kept = [old for old in text.splitlines() if not old.startswith(key)]
    return "\n".join(kept + [line.rstrip("\n")]) + "\n"


# The seed config asks for 2048 + 4096 tokens; the built-in model holds 256 (preflight refuses more).
FITS_BUILTIN_MODEL = ["prompt_length=64", "response_length=128"]


def load(tmp_path, text=BASE, overrides=()):
    return load_config(write(tmp_path, text), list(overrides))


def problems(tmp_path, text=BASE, overrides=()):
    """The ConfigError message a config must raise."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, overrides)
    return str(info.value)


def run_cli(*args, timeout=180):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_COMPILE_DISABLE="1")
    return subprocess.run([sys.executable, "run_pipeline.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


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


def test_half_precision_on_a_cpu_without_its_matrix_instructions(tmp_path, monkeypatch):
    """fp16 on a CPU without fp16 instructions is refused before workers start, naming the key;
    bf16 without bf16 instructions is a warning (runs, slower than fp32)."""
    from roll_gspo.config.plan import cpu_precision

    cfg = load(tmp_path, BASE + "actor_infer:\n  strategy_args:\n    strategy_name: hf_infer\n",
               overrides=FITS_BUILTIN_MODEL + ["actor_train.model_args.dtype=fp16", "actor_infer.model_args.dtype=bf16"])
    epyc = ("avx2", "avx512f", "avx512_bf16")  # this project's machine: bf16 yes, fp16 no
    found = {f.key: f for f in cpu_precision.cpu_precision_findings(cfg, epyc)}
    assert list(found) == ["actor_train.model_args.dtype"] and found["actor_train.model_args.dtype"].level == "error"
    assert "use bf16" in found["actor_train.model_args.dtype"].text
    old = {f.key: f for f in cpu_precision.cpu_precision_findings(cfg, ("avx2", "avx512f"))}
    assert old["actor_train.model_args.dtype"].level == "error" and "use fp32" in old["actor_train.model_args.dtype"].text
    assert old["actor_infer.model_args.dtype"].level == "warning"
    assert old["actor_infer.model_args.dtype"].remedy == "fp32 is faster here and exact"
    assert cpu_precision.cpu_precision_findings(cfg, ("avx512_fp16", "amx_bf16")) == []
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: epyc)
    with pytest.raises(ConfigError, match="actor_train.model_args.dtype = fp16 on a CPU without fp16"):
        preflight(cfg)


@pytest.mark.parametrize("flags, dtype, old_logprobs", [
    (("avx2", "avx512f"), "fp32", "rollout"),  # no bf16 instructions: fp32, vLLM's log-probs are the trainer's
    (("avx512f", "avx512_bf16"), "bf16", "trainer"),  # bf16 ones: bf16, the trainer's pass and the correction
    (("amx_bf16",), "bf16", "trainer"),
])
def test_dtype_auto_takes_the_cpus_faster_precision_with_one_notice(tmp_path, monkeypatch, flags, dtype, old_logprobs):
    from roll_gspo.config.plan import cpu_precision
    from roll_gspo.config.load.loader import load_config_findings
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: flags)
    text = BASE + "train_infer_correction: {is_weight: {enabled: true, weight_type: geometric, upper_bound: 1.2}}\n"
    cfg, findings = load_config_findings(write(tmp_path, text), FITS_BUILTIN_MODEL + [
        "actor_train.model_args.dtype=auto", "actor_infer.model_args.dtype=auto", "reference.model_args.dtype=fp32"])
    assert (cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype) == (dtype, dtype)
    assert cfg.reference.model_args.dtype == "fp32"  # written, not auto: left alone
    said = [f for f in findings if f.text.startswith(f"notice: dtype: auto -> {dtype}")]
    assert [f.key for f in said] == ["actor_train.model_args.dtype", "actor_infer.model_args.dtype"]
    assert len({f.text for f in said}) == 1 and "actor_train.model_args.dtype, actor_infer.model_args.dtype" in said[0].text
    assert choose_old_logprob_source(cfg).source == old_logprobs  # the correction acts only where the gap opens
    assert cpu_precision.cpu_precision_findings(cfg, flags) == []  # auto never picks what the CPU warns of


def test_dtype_auto_on_a_gpu_role_is_bf16(tmp_path):
    from roll_gspo.config.plan import cpu_precision

    cfg = load(tmp_path, overrides=FITS_BUILTIN_MODEL)
    cfg.actor_train.model_args.dtype = cfg.actor_infer.model_args.dtype = "auto"
    cfg.actor_infer.device_mapping = [0]
    texts = {f.key: f.text for f in cpu_precision.resolve_auto_dtypes(cfg, ("avx2",))}
    assert (cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype) == ("fp32", "bf16")
    assert "GPU" in texts["actor_infer.model_args.dtype"] and "no bf16" in texts["actor_train.model_args.dtype"]
    assert cpu_precision.resolve_auto_dtypes(cfg, ("avx2",)) == []  # nothing left to choose

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


def test_cli_misspelled_override_fails_with_suggestion():
    result = run_cli("--config", "example_gspo.yaml", "--print-config",
                     "actor_train.training_args.learnig_rate=1e-5")
    assert result.returncode == 1, result.stdout
    assert "did you mean 'actor_train.training_args.learning_rate'" in result.stderr
    assert "importance_sampling" not in result.stdout


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
# Warnings (GSPO traps)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def config_log(caplog):
    """Records of logger roll_gspo.config, even when setup_logging() turned propagation off."""
    logger = logging.getLogger("roll_gspo.config")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="roll_gspo.config")
    yield caplog
    logger.removeHandler(caplog.handler)


def warning_messages(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "roll_gspo.config" and r.levelno == logging.WARNING]


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


# --------------------------------------------------------------------------------------------
# Hydra override grammar, interpolation, composition
# --------------------------------------------------------------------------------------------
def test_dotted_override_sets_nested_values_typed(tmp_path):
    cfg = load(tmp_path, overrides=["actor_train.training_args.per_device_train_batch_size=16",
                                    "actor_train.training_args.learning_rate=3e-5",
                                    "reward_clip=5", "reward_norm=batch", "advantage_clip=null"])
    assert cfg.actor_train.training_args.per_device_train_batch_size == 16
    assert cfg.actor_train.training_args.learning_rate == 3e-5
    assert cfg.reward_clip == 5.0 and type(cfg.reward_clip) is float
    assert cfg.reward_norm == "batch"
    assert cfg.advantage_clip is None


def test_override_of_schema_key_absent_from_yaml_needs_no_plus(tmp_path):
    assert "kl_estimator" not in BASE and "reference:" not in BASE
    cfg = load(tmp_path, overrides=["kl_estimator=k1", "reference.model_args.dtype=bf16",
                                    "old_logprob_source=rollout"])
    assert cfg.kl_estimator == "k1"
    assert cfg.reference.model_args.dtype == "bf16"
    assert cfg.old_logprob_source == "rollout"


def test_plus_schema_key_absent_from_yaml_is_allowed(tmp_path):
    assert load(tmp_path, overrides=["+max_steps=3"]).max_steps == 3


@pytest.mark.parametrize("override, unknown", [
    ("+new_key=1", "new_key"),
    ("+actor_train.training_args.new_thing=1", "actor_train.training_args.new_thing"),
])
def test_plus_new_key_is_rejected_as_unknown(tmp_path, override, unknown):
    assert f"unknown key {unknown!r}" in problems(tmp_path, overrides=[override])


def test_plus_existing_key_is_rejected(tmp_path):
    assert "already exists" in problems(tmp_path, overrides=["+kl_loss_coef=0.01"])


def test_tilde_removes_a_key_and_the_default_returns(tmp_path):
    text = BASE.replace("    gradient_accumulation_steps: 8\n",
                        "    gradient_accumulation_steps: 8\n    learning_rate: 5.0e-6\n") + "max_steps: 7\n"
    cfg = load(tmp_path, text)
    assert cfg.max_steps == 7 and cfg.actor_train.training_args.learning_rate == 5e-6
    cfg = load(tmp_path, text, ["~max_steps", "~actor_train.training_args.learning_rate", "~reward_clip"])
    defaults = PipelineConfig()
    assert cfg.max_steps == defaults.max_steps != 7
    assert cfg.actor_train.training_args.learning_rate == defaults.actor_train.training_args.learning_rate
    assert cfg.reward_clip is None


def test_tilde_of_absent_key_fails(tmp_path):
    assert "no key 'max_steps' to delete" in problems(tmp_path, overrides=["~max_steps"])


def test_malformed_override_fails_cleanly(tmp_path):
    message = problems(tmp_path, overrides=["max_steps=[1,"])
    assert "override" in message


def test_interpolation_and_private_anchors(tmp_path):
    text = BASE.replace("response_length: 4096", "response_length: ${prompt_length}").replace(
        "    per_device_train_batch_size: 8\n",
        "    per_device_train_batch_size: ${_micro}\n    learning_rate: ${_lr}\n")
    text = "_micro: 16\n_lr: 3.0e-5\n" + text + "exp_name: gspo_${adv_estimator}\n"
    cfg = load(tmp_path, text)
    assert cfg.response_length == 2048
    assert cfg.actor_train.training_args.per_device_train_batch_size == 16
    assert cfg.actor_train.training_args.learning_rate == 3e-5
    assert cfg.exp_name == "gspo_reinforce"
    assert cfg.output_dir == "./output/gspo_reinforce"  # the schema's default interpolates too
    top_level = [line.split(":")[0] for line in config_to_yaml(cfg).splitlines() if not line.startswith(" ")]
    assert "_micro" not in top_level and "_lr" not in top_level


def test_interpolation_of_a_default_not_written_in_the_yaml(tmp_path):
    cfg = load(tmp_path, BASE + "exp_name: ${pipeline}_run\n")
    assert cfg.exp_name == "rlvr_run"


def test_interpolated_value_is_type_checked(tmp_path):
    message = problems(tmp_path, "_n: abc\n" + BASE.replace("ppo_epochs: 1", "ppo_epochs: ${_n}"))
    assert "ppo_epochs: expected int, got str 'abc'" in message


def test_broken_interpolation_fails(tmp_path):
    message = problems(tmp_path, BASE.replace("response_length: 4096", "response_length: ${no_such_key}"))
    assert "interpolation" in message and "no_such_key" in message


def test_hydra_defaults_list_composes_a_sibling_yaml(tmp_path):
    write(tmp_path, BASE + "max_steps: 5\n", "base_gspo.yaml")
    child = write(tmp_path, "defaults:\n  - base_gspo\n  - _self_\nmax_steps: 7\nppo_epochs: 2\n", "child.yaml")
    cfg = load_config(child)
    assert cfg.max_steps == 7 and cfg.ppo_epochs == 2            # the child's own keys win
    assert cfg.adv_estimator == "reinforce"                      # the rest comes from base_gspo.yaml
    assert cfg.loss_agg_mode == "seq-mean-token-sum"
    assert cfg.actor_train.data_args.file_name == ["builtin:arith/train"]


def test_hydra_defaults_list_without_self_still_lets_the_child_win(tmp_path):
    write(tmp_path, BASE + "max_steps: 5\n", "base_gspo.yaml")
    child = write(tmp_path, "defaults:\n  - base_gspo\nmax_steps: 7\n", "child.yaml")
    assert load_config(child).max_steps == 7


def test_yml_extension_is_read(tmp_path):
    assert load_config(write(tmp_path, BASE + "max_steps: 9\n", "cfg.yml")).max_steps == 9


def test_yaml_syntax_error_is_a_config_error(tmp_path):
    message = problems(tmp_path, BASE + "max_steps: [1\n")
    assert "cannot be read as a YAML config" in message


# --------------------------------------------------------------------------------------------
# resume_from_checkpoint spellings
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    ("true", "auto"), ("false", None), ("auto", "auto"), ("null", None), ("/ckpt/step_10", "/ckpt/step_10"),
])
def test_resume_from_checkpoint_spellings(tmp_path, value, expected):
    assert load(tmp_path, BASE + f"resume_from_checkpoint: {value}\n").resume_from_checkpoint == expected


def test_resume_from_checkpoint_bool_override(tmp_path):
    assert load(tmp_path, overrides=["resume_from_checkpoint=true"]).resume_from_checkpoint == "auto"
    assert load(tmp_path, overrides=["resume_from_checkpoint=false"]).resume_from_checkpoint is None


# --------------------------------------------------------------------------------------------
# Finding configs, and preflight in-process
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


def test_preflight_checks_data_files_in_process(tmp_path):
    good = tmp_path / "train.jsonl"
    good.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n')
    cfg = load(tmp_path, overrides=[f"actor_train.data_args.file_name=[{good}]", *FITS_BUILTIN_MODEL,
                                    "actor_infer.strategy_args.strategy_name=hf_infer"])
    preflight(cfg)
    bad = tmp_path / "train.txt"
    bad.write_text("x\n")
    cfg = load(tmp_path, overrides=[f"actor_train.data_args.file_name=[{bad}]",
                                    "validation.data_args.file_name=[builtin:arith/nope]",
                                    "actor_infer.strategy_args.strategy_name=hf_infer"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "is not a .jsonl, .json or .parquet file" in message
    assert "unknown built-in data set 'builtin:arith/nope'" in message


@pytest.mark.parametrize("reward_fn, ok", [
    ("os.path:join", True), ("os.path.join", True),
    ("os.path:no_such_fn", False), ("no_such_module_abc:score", False),
])
def test_preflight_imports_reward_fn_in_process(tmp_path, reward_fn, ok):
    cfg = load(tmp_path, overrides=["rewards.math_rule.worker_cls=roll_gspo.workers.rewards.FunctionRewardWorker",
                                    f"rewards.math_rule.reward_fn={reward_fn}", *FITS_BUILTIN_MODEL,
                                    "actor_infer.strategy_args.strategy_name=hf_infer"])
    if ok:
        preflight(cfg)
    else:
        with pytest.raises(ConfigError, match=f"rewards.math_rule.reward_fn.*{reward_fn}"):
            preflight(cfg)


def test_function_reward_worker_needs_reward_fn(tmp_path):
    message = problems(tmp_path, overrides=["rewards.math_rule.worker_cls=roll_gspo.workers.rewards.FunctionRewardWorker"])
    assert "rewards.math_rule.reward_fn" in message


# --------------------------------------------------------------------------------------------
# The CLI (subprocesses; only the two vLLM-engine runs import vllm)
# --------------------------------------------------------------------------------------------
def test_cli_print_config_prints_resolved_loadable_yaml(tmp_path):
    result = run_cli("--config", "example_gspo.yaml", "--print-config")
    assert result.returncode == 0, result.stderr
    assert "importance_sampling: seq" in result.stdout
    printed = yaml.safe_load(result.stdout)
    assert printed["output_dir"] == "./output/example_gspo"              # interpolation resolved
    assert printed["kl_estimator"] == "k3"                               # defaults filled in
    assert printed["actor_infer"]["generating_args"]["num_return_sequences"] == 8
    # The printed config is itself a valid config describing the same run.
    again = load_config(write(tmp_path, result.stdout, "printed.yaml"))
    assert dataclasses.asdict(again) == dataclasses.asdict(load_config(str(EXAMPLE)))


def test_cli_dry_run_example_passes():
    result = run_cli("--config", "example_gspo.yaml", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout


def test_cli_missing_config_file_exits_1():
    result = run_cli("--config", "no_such_config_xyz.yaml", "--dry-run")
    assert result.returncode == 1
    assert "no_such_config_xyz.yaml" in result.stderr and "not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_dry_run_missing_data_file_exits_1(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    text = BASE.replace("file_name: [builtin:arith/train]", f"file_name: [{missing}]")
    text += "actor_infer:\n  strategy_args:\n    strategy_name: hf_infer\n"
    result = run_cli("--config", write(tmp_path, text), "--dry-run")
    assert result.returncode == 1, result.stdout
    assert str(missing) in result.stderr and "does not exist" in result.stderr
    assert "model folder" not in result.stderr  # only the real problem is reported


def test_cli_dry_run_missing_model_folder_exits_1(tmp_path):
    folder = tmp_path / "no_model_here"
    result = run_cli("--config", "example_gspo.yaml", "--dry-run", f"pretrain={folder}",
                     "actor_infer.strategy_args.strategy_name=hf_infer")
    assert result.returncode == 1, result.stdout
    assert f"model folder '{folder}' does not exist" in result.stderr


def test_cli_dry_run_unknown_vllm_engine_key_exits_1():
    result = run_cli("--config", "example_gspo.yaml", "--dry-run",
                     "actor_infer.strategy_args.strategy_config.enforce_eagr=true")
    assert result.returncode == 1, result.stdout
    assert "actor_infer.strategy_args.strategy_config.enforce_eagr" in result.stderr
    assert "did you mean 'enforce_eager'" in result.stderr


def test_cli_dry_run_unimportable_reward_fn_exits_1():
    result = run_cli("--config", "example_gspo.yaml", "--dry-run",
                     "rewards.math_rule.worker_cls=roll_gspo.workers.rewards.FunctionRewardWorker",
                     "rewards.math_rule.reward_fn=no_such_module_abc.rewards:score",
                     "actor_infer.strategy_args.strategy_name=hf_infer")
    assert result.returncode == 1, result.stdout
    assert "rewards.math_rule.reward_fn" in result.stderr
    assert "no_such_module_abc.rewards:score" in result.stderr


# --------------------------------------------------------------------------------------------
# The generated reference
# --------------------------------------------------------------------------------------------
def _schema_fields(cls, prefix=""):
    """(full path, field) of every schema field, nested blocks included."""
    hints = typing.get_type_hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        path = f"{prefix}.{field.name}" if prefix else field.name
        out.append((path, field))
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            out += _schema_fields(tp, path)
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            block = typing.get_args(tp)[1]
            out += _schema_fields(block, f"{path}.<{'domain' if block.__name__ == 'RewardConfig' else 'tag'}>")
    return out


def test_every_schema_field_has_help():
    fields = _schema_fields(PipelineConfig)
    assert len(fields) > 100
    missing = [path for path, field in fields if not field.metadata.get("help", "").strip()]
    assert missing == []


def test_reference_documents_every_key_with_type_default_choices_help():
    text = render_reference()
    lines = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("- **`")}
    for path, field in _schema_fields(PipelineConfig):
        if path in lines:
            line = lines[path]
            assert " ".join(field.metadata["help"].split()) in line, path
            for choice in field.metadata.get("choices", []):
                assert ("`null`" if choice is None else f'`"{choice}"`') in line, (path, choice)
        else:  # a block: documented as a section heading
            assert f"`{path}`" in text, path
    assert '**`actor_infer.strategy_args.strategy_name`** (str; default `"vllm"`' in text
    assert '**`actor_train.strategy_args.strategy_name`** (str; default `"deepspeed_train"`' in text
    assert "**`validation.generating_args.temperature`** (float; default `0.0`)" in text
    assert "**`reward_norm`** (str or null; default `null`; one of `null`" in text
    assert "**`rewards.<domain>.worker_cls`**" in text


def test_docs_config_reference_is_in_sync():
    path = REPO / "docs" / "config_reference.md"
    assert path.is_file(), "run `python -m roll_gspo.config.load.config_reference --write`"
    assert path.read_text() == render_reference(), "run `python -m roll_gspo.config.load.config_reference --write`"


def test_reference_module_prints_and_checks(capsys):
    assert reference_main([]) == 0
    assert capsys.readouterr().out == render_reference()
    assert reference_main(["--check"]) == 0


def test_a_foreign_vllm_worker_extension_is_refused_by_name():
    from roll_gspo.strategies.vllm_strategy import EXTENSION, WeightUpdateExtension, _check_extension

    _check_extension(EXTENSION)  # ours passes
    with pytest.raises(ValueError, match="worker_extension_cls='roll_gspo.rewards.math_verify_reward' must subclass"):
        _check_extension("roll_gspo.rewards.math_verify_reward")
    assert WeightUpdateExtension.__module__ + "." + WeightUpdateExtension.__qualname__ == EXTENSION


# --------------------------------------------------------------------------------------------
# Issue 9: rollout log-probs, sampling keys, config holes, unread keys, stale and many steps
# --------------------------------------------------------------------------------------------
ROLLOUT = ["old_logprob_source=rollout"]


@pytest.mark.parametrize("overrides", [
    ROLLOUT + ["actor_infer.generating_args.top_p=0.9", "actor_infer.generating_args.temperature=0.7"],
    ROLLOUT + ["actor_infer.generating_args.top_k=20", "actor_infer.generating_args.temperature=0.7"],
    ROLLOUT + ["+actor_infer.strategy_args.strategy_config.logprobs_mode=processed_logprobs"],
])
def test_rollout_log_probs_that_are_not_the_trainers_are_refused(tmp_path, overrides):
    message = problems(tmp_path, overrides=overrides)
    assert "old_logprob_source: rollout would bias every importance ratio" in message
    assert "old_logprob_source: trainer" in message  # the way out


@pytest.mark.parametrize("overrides, exact", [
    (ROLLOUT + ["actor_infer.generating_args.top_p=0.9"], True),             # temperature 1: raw log-probs
    (ROLLOUT + ["actor_infer.generating_args.temperature=0.7"], True),       # no cut: processed log-probs
    (ROLLOUT + ["actor_infer.generating_args.top_p=0.9", "actor_infer.generating_args.temperature=0.7",
                "actor_infer.strategy_args.strategy_name=hf_infer"], True),  # hf_infer re-scores
    (ROLLOUT + ["actor_infer.model_args.dtype=bf16"], False),                # allowed, but not exact
])
def test_exact_rollout_log_probs_are_accepted(tmp_path, overrides, exact):
    from roll_gspo.config.plan.engine_logprobs import rollout_logprobs_are_exact

    cfg = load(tmp_path, overrides=overrides)
    ok, reason = rollout_logprobs_are_exact(cfg)
    assert ok == exact and (ok or "bf16" in reason)


AUTO_CASES = [  # (overrides, moe, source, a fragment of the reason)
    ([], False, "rollout", "forward pass is skipped"),  # the seed block: seq ratio, fp32 vLLM at temperature 1
    (["actor_infer.generating_args.top_p=0.9"], False, "rollout", "forward pass is skipped"),  # raw log-probs
    (["actor_infer.generating_args.temperature=0.7"], False, "rollout", "forward pass is skipped"),  # processed
    (["importance_sampling=gspo-token"], False, "rollout", "forward pass is skipped"),  # the sequence ratio
    (["actor_infer.strategy_args.strategy_name=hf_infer", "actor_infer.generating_args.top_p=0.9",
      "actor_infer.generating_args.temperature=0.7"], False, "rollout", "hf_infer"),  # re-scored exactly
    (["actor_infer.generating_args.top_p=0.9", "actor_infer.generating_args.temperature=0.7"], False, "trainer",
     "never the full distribution"),
    (["+actor_infer.strategy_args.strategy_config.logprobs_mode=raw_logprobs"], False, "trainer", "overrides"),
    (["actor_infer.model_args.dtype=bf16"], False, "trainer", "until a step measures a mean gap below"),
    (["actor_train.model_args.dtype=bf16", "old_logprob_auto_max_gap=0"], False, "trainer", "outside fp32"),
    # token ratios: in fp32 each token's engine mismatch is ~1e-6 against a 0.2 clip; in bf16 it is not averaged
    (["importance_sampling=token", "pg_clip_low=0.2", "pg_clip_high=0.28"], False, "rollout", "forward pass is skipped"),
    (["importance_sampling=token", "pg_clip_low=0.2", "pg_clip_high=0.28", "actor_infer.model_args.dtype=bf16"], False,
     "trainer", "importance_sampling: token"),
    (["router_replay=true"], True, "trainer", "router_replay"),
    ([], True, "trainer", "Mixture-of-Experts"),
    (["model_update_frequency=2"], False, "trainer", "stale weights"),
    (["old_logprob_source=trainer"], False, "trainer", "in the config"),
    (["old_logprob_source=rollout", "importance_sampling=token", "pg_clip_low=0.2", "pg_clip_high=0.28"], False,
     "rollout", "in the config"),  # explicit wins (and warns)
]


@pytest.mark.parametrize("overrides, moe, source, reason", AUTO_CASES)
def test_old_logprob_source_auto_takes_rollout_log_probs_only_where_exact_and_unneeded(
        tmp_path, overrides, moe, source, reason):
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    cfg = load(tmp_path, overrides=overrides)
    choice = choose_old_logprob_source(cfg, model_is_moe=moe)
    assert (choice.source, reason in choice.reason) == (source, True), choice.reason


def test_old_logprob_source_auto_outside_fp32_follows_the_measured_gap(tmp_path):
    """bf16: the trainer's old log-probs until a step's gap is below the threshold (default a
    tenth of pg_clip_low), then the rollout engine's, and back when the gap grows again."""
    from types import SimpleNamespace

    from pipelines.trainer_loop import TrainerLoop
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    cfg = load(tmp_path, overrides=["actor_infer.model_args.dtype=bf16", "pg_clip_low=3e-3"])
    choice = choose_old_logprob_source(cfg)
    assert (choice.source, choice.max_gap) == ("trainer", pytest.approx(3e-4))
    pipeline = SimpleNamespace(old_logprobs=choice)
    sources = []
    for step, gap in enumerate([2e-2, 1e-4, None, 2e-4, 5e-4, 4e-4], start=1):
        TrainerLoop._follow_logprob_gap(pipeline, step, gap)
        sources.append(pipeline.old_logprobs.source)
    assert sources == ["trainer", "rollout", "rollout", "rollout", "trainer", "trainer"]
    assert "5e-04" in pipeline.old_logprobs.reason or "0.0005" in pipeline.old_logprobs.reason
    assert choose_old_logprob_source(load(tmp_path, overrides=["actor_infer.model_args.dtype=bf16",
                                                               "old_logprob_auto_max_gap=0"])).max_gap is None
    assert "old_logprob_auto_max_gap must be >= 0" in problems(tmp_path, overrides=["old_logprob_auto_max_gap=-1"])


def test_old_logprob_source_defaults_to_auto_and_router_replay_is_refused_only_with_rollout(tmp_path):
    assert load(tmp_path).old_logprob_source == "auto"
    assert load(tmp_path, overrides=["router_replay=true"]).router_replay  # auto: the trainer's pass
    assert "it needs old_logprob_source: trainer" in problems(
        tmp_path, overrides=["router_replay=true", "old_logprob_source=rollout"])


def test_folder_is_moe_reads_the_models_config(tmp_path):
    from transformers import Qwen2Config, Qwen3MoeConfig

    from roll_gspo.models.moe_routing import folder_is_moe

    Qwen2Config(hidden_size=32, num_hidden_layers=1).save_pretrained(tmp_path / "dense")
    Qwen3MoeConfig(hidden_size=32, num_hidden_layers=1, num_experts=4).save_pretrained(tmp_path / "moe")
    assert not folder_is_moe(str(tmp_path / "dense")) and folder_is_moe(str(tmp_path / "moe"))


@pytest.mark.parametrize("generating, mode", [
    ({}, "processed_logprobs"), ({"temperature": 0.6}, "processed_logprobs"),
    ({"top_p": 0.9}, "raw_logprobs"), ({"top_k": 20, "temperature": 0.0}, "raw_logprobs"),
    ({"top_p": 0.9, "temperature": 0.6}, "processed_logprobs"),  # no exact mode: refused with rollout
])
def test_vllm_engine_args_pick_the_log_probs_the_trainer_scores_and_ignore_generation_config(generating, mode):
    from roll_gspo.schema.config import GeneratingArgs, RoleConfig
    from roll_gspo.strategies.vllm_strategy import vllm_engine_args

    role = RoleConfig(generating_args=GeneratingArgs(**generating))
    args = vllm_engine_args(role, max_model_len=32, seed=0)
    assert args["logprobs_mode"] == mode and args["generation_config"] == "vllm"


@pytest.mark.parametrize("key", ["+actor_infer.strategy_args.strategy_config.generation_config=auto",
                                 "+actor_infer.strategy_args.strategy_config.override_generation_config={top_k: 5}"])
def test_sampling_defaults_from_the_model_folder_are_refused(tmp_path, key):
    assert "sampling comes from actor_infer.generating_args only" in problems(tmp_path, overrides=[key])


def test_logprobs_mode_override_with_trainer_log_probs_warns(tmp_path, config_log):
    load(tmp_path, overrides=["+actor_infer.strategy_args.strategy_config.logprobs_mode=raw_logits"])
    assert any("logprobs_mode = 'raw_logits' only changes the logged rollout/logprob_gap" in m
               for m in warning_messages(config_log))


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


def test_null_means_the_default_and_zero_is_not_null(tmp_path):
    cfg = load(tmp_path)
    assert (cfg.actor_infer.generating_args.max_new_tokens, cfg.loss_norm_length) == (4096, 4096)
    assert cfg.validation.generating_args.num_return_sequences == 1


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
    paths = {p for p, _ in _schema_fields(PipelineConfig)}
    assert set(UNREAD_KEYS) <= paths


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


def test_async_generation_with_auto_takes_rollout_log_probs_or_is_refused(tmp_path):
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    cfg = load(tmp_path, overrides=["async_generation_ratio=1", "actor_infer.model_args.dtype=bf16"])
    choice = choose_old_logprob_source(cfg, model_is_moe=True)  # neither bf16 nor an MoE brings the trainer's
    assert (choice.source, choice.max_gap) == ("rollout", None) and "async_generation_ratio" in choice.reason
    assert "needs the rollout engine's old log-probs" in problems(
        tmp_path, overrides=["async_generation_ratio=1", "router_replay=true"])
    assert "would bias every ratio" in problems(
        tmp_path, overrides=["async_generation_ratio=1", "actor_infer.generating_args.top_p=0.9",
                             "actor_infer.generating_args.temperature=0.7"])


@pytest.mark.parametrize("overrides, expected", [
    (["prompt_length=200", "response_length=100"],
     "prompt_length + response_length = 200 + 100 = 300, but the model 'builtin:tiny-arith' "
     "(actor_train.model_args.model_name_or_path, actor_infer.model_args.model_name_or_path"),
    (FITS_BUILTIN_MODEL + ["+actor_infer.strategy_args.strategy_config.max_model_len=8000"],
     "actor_infer.strategy_args.strategy_config.max_model_len = 8000, but the model 'builtin:tiny-arith'"),
])
def test_preflight_refuses_lengths_the_model_cannot_hold(tmp_path, overrides, expected):
    """A ROLL recipe's max_model_len: 8000 on a 256-position model used to reach vLLM's start-up as
    a worker trace; it is a config error naming the key and the limit now."""
    cfg = load(tmp_path, overrides=overrides)
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert expected in str(info.value) and "holds at most 256 tokens" in str(info.value)


def test_model_max_positions_reads_the_folder_and_rope_scaling(tmp_path):
    from roll_gspo.config.checks.preflight import model_max_positions

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    assert model_max_positions(str(tmp_path)) == 4096
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768, "rope_scaling": '
                                          '{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}')
    assert model_max_positions(str(tmp_path)) == 131072
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert model_max_positions(str(tmp_path)) is None
    assert model_max_positions("builtin:tiny-arith") == 256


def test_system_envs_take_yaml_integers_as_strings_and_refuse_booleans():
    """`OMP_NUM_THREADS: 2` is what users write (YAML reads an int; Ray's env_vars want strings)."""
    cfg = load_config("example_gspo.yaml", ["+system_envs.MALLOC_ARENA_MAX=2", "actor_infer.system_envs.OMP_NUM_THREADS=1"])
    assert cfg.system_envs["MALLOC_ARENA_MAX"] == "2" and cfg.actor_infer.system_envs["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ConfigError, match=r"system_envs.VERBOSE: expected str, got bool True"):
        load_config("example_gspo.yaml", ["+system_envs.VERBOSE=true"])


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
    load(tmp_path, overrides=[f"+{ENGINE}.max_num_batched_tokens=32768"])  # the workaround
    load(tmp_path, overrides=[f"+{ENGINE}.enable_chunked_prefill=true", f"+{ENGINE}.max_num_seqs=2",
                              f"+{ENGINE}.max_num_batched_tokens=12288"])  # 2 x 6144: nothing ever split
