"""run_pipeline.py's config flags in subprocesses: --print-config, --dry-run and their exit codes
(only the two vLLM-engine runs import vllm)."""
import dataclasses

import yaml

from roll_gspo.config import load_config
from tests.config_helpers import BASE, EXAMPLE, run_cli, write


# --------------------------------------------------------------------------------------------
# The CLI (subprocesses; only the two vLLM-engine runs import vllm)
# --------------------------------------------------------------------------------------------
def test_cli_misspelled_override_fails_with_suggestion():
    result = run_cli("--config", "example_gspo.yaml", "--print-config",
                     "actor_train.training_args.learnig_rate=1e-5")
    assert result.returncode == 1, result.stdout
    assert "did you mean 'actor_train.training_args.learning_rate'" in result.stderr
    assert "importance_sampling" not in result.stdout


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
