"""Hydra on the command line and in the YAML (roll_gspo.config): dotted overrides, `+` and `~`,
interpolation and private anchors, defaults lists, file extensions and syntax errors. Fast."""
import pytest

from roll_gspo.config import config_to_yaml, load_config
from roll_gspo.schema.config import PipelineConfig
from tests.config_helpers import BASE, load, problems, write


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
