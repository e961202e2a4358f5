"""ROLL's own examples for on-policy distillation and the policy-gradient variants
(tests/data/roll/examples/, each unchanged from alibaba/ROLL at 8eb27cc) loaded here with only
models, data and outputs changed: the pg_var FrozenLake recipe loads, passes preflight and --dry-run;
the on-policy distill recipe (student_train / student_infer / teacher, run by ROLL's launcher that
sets is_pure_opd) is read as pure OPD on a CPU host, its Megatron strategies as DeepSpeed's (model-
parallel sizes 1) and its sequence packing as token budgets, each said in a notice; on a GPU cluster
Megatron's model parallelism is refused naming each key. Config-level: no Ray, no weights."""
import json
import logging
from pathlib import Path

import pytest

from roll_gspo.config import ConfigError, load_config, preflight
from tests.config_helpers import small_qwen2_config_folder

REPO = Path(__file__).resolve().parents[1]
ROLL_DIR = REPO / "tests" / "data" / "roll"
OPD = ROLL_DIR / "examples" / "onpolicy_distill_config.yaml"
PG_VAR = ROLL_DIR / "examples" / "agent_val_frozen_lake-pg_var.yaml"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A model folder holding only a config (Qwen2.5-0.5B's shape, 32768 positions): ROLL's lengths
    need a model that holds them; nothing is loaded."""
    folder = tmp_path_factory.mktemp("qwen2.5-0.5b-config")
    config = json.loads((REPO / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B.json").read_text())
    config.setdefault("max_position_embeddings", 32768)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A config-only small Qwen2 holding ROLL's 8192-token agentic trajectories (as tests/test_cpu_run.py's:
    the host-memory plan of --dry-run fits it on this machine)."""
    return small_qwen2_config_folder(tmp_path_factory.mktemp("small-qwen2"))


@pytest.fixture
def in_roll_dir(monkeypatch):
    monkeypatch.chdir(ROLL_DIR)  # ROLL runs from its repository root; its data and defaults paths are relative


def outputs(out) -> list:
    return [f"output_dir={out}", f"logging_dir={out}/logs", f"rollout_dump_dir={out}/dump",
            f"checkpoint_config.output_dir={out}/ckpt"]


def opd_overrides(model: str, out) -> list:
    """Models (student, reward, teacher), data (DAPO-Math is not in tests/data: another math file) and
    outputs: nothing else of ROLL's recipe changes."""
    return [f"pretrain={model}", f"reward_pretrain={model}", f"teacher.model_args.model_name_or_path={model}",
            "student_train.data_args.file_name=[data/math_deepmath_deal.jsonl]", *outputs(out)]


def test_roll_onpolicy_distill_example_on_a_gpu_cluster_refuses_megatron_model_parallelism(model_folder, tmp_path,
                                                                                         in_roll_dir):
    """Loaded for a GPU cluster with DeepSpeed in Megatron's place, the model-parallel sizes above 1
    are refused naming each key (DeepSpeed ranks are data-parallel); nothing else is, and no key of
    ROLL's YAML is unknown (num_nodes, student_*, teacher, sequence packing, interleave_probs "1.0")."""
    deepspeed = ["student_train.strategy_args.strategy_name=deepspeed_train",
                 "teacher.strategy_args.strategy_name=deepspeed_infer"]
    with pytest.raises(ConfigError) as info:
        load_config(str(OPD), opd_overrides(model_folder, tmp_path) + deepspeed, cpu_host=False)
    message = str(info.value)
    assert "unknown key" not in message
    for key in ("pipeline_model_parallel_size = 2", "context_parallel_size = 2"):
        assert key in message and "Megatron model parallelism is not built" in message, key
    assert "sequence packing" not in message and "interleave_probs" not in message


def test_roll_onpolicy_distill_example_runs_as_pure_opd(model_folder, tmp_path, in_roll_dir, caplog, capsys):
    """ROLL's recipe as written, models, data and outputs changed, on a CPU host: pure OPD as its
    launcher makes it (student_* are actor_train / actor_infer, the teacher its own role), Megatron's
    strategies as DeepSpeed's with their model-parallel sizes 1, sequence packing as token budgets;
    each said in a notice."""
    with caplog.at_level(logging.WARNING):
        cfg = load_config(str(OPD), opd_overrides(model_folder, tmp_path), cpu_host=True)
    preflight(cfg)
    assert cfg.is_pure_opd and not cfg.use_opd and cfg.uses_teacher() and cfg.opd_kl_coef == 1.0
    assert caplog.text.count("as ROLL's start_onpolicy_distill_pipeline.py sets it") == 1
    assert cfg.actor_train.training_args.learning_rate == 5.0e-7  # student_train's
    assert cfg.actor_infer.generating_args.temperature == 0.99  # student_infer's
    assert cfg.actor_train.strategy_args.strategy_name == "deepspeed_train"
    assert cfg.teacher.strategy_args.strategy_name == "deepspeed_infer"
    assert "Megatron model-parallel sizes -> 1" in caplog.text
    assert "teacher.strategy_args.strategy_config.pipeline_model_parallel_size = 4" in caplog.text
    assert cfg.actor_train.use_dynamic_batching_in_train and cfg.actor_train.max_tokens_per_microbatch_in_train == 16384
    assert cfg.actor_train.max_tokens_per_microbatch_in_infer == 16384
    assert "teacher.sequence_packing_args: read only with teacher.use_sequence_packing" in caplog.text
    assert cfg.actor_train.data_args.interleave_probs is None  # "1.0": one file, as written
    from roll_gspo.cli import main

    # --dry-run on this CPU: the plan with the teacher's role, then ROLL's 2048 + 14336-token
    # sequences refused on host memory, naming the trainer's logits and what to lower.
    capsys.readouterr()
    assert main(["--config", str(OPD), "--dry-run", *opd_overrides(model_folder, tmp_path)]) != 0
    out, err = capsys.readouterr()
    assert "teacher: 1 x deepspeed_infer" in out and "host memory: does not fit" in err and "logits" in err


def test_roll_pure_and_mixed_opd_at_once_is_refused_as_roll_refuses_it(model_folder, tmp_path, in_roll_dir):
    with pytest.raises(ConfigError, match="is_pure_opd and use_opd are both true"):
        load_config(str(OPD), opd_overrides(model_folder, tmp_path) + ["is_pure_opd=true", "use_opd=true"],
                    cpu_host=True)


def test_roll_pg_var_frozen_lake_example_loads_and_passes_dry_run(small_model, tmp_path, in_roll_dir, monkeypatch,
                                                                  capsys):
    """ROLL's agent_val_frozen_lake-pg_var.yaml as ROLL has it (its agentic PG worker named in
    actor_train.worker_cls, `pg_variant: topr`, generating_args under actor_infer)."""
    over = [f"pretrain={small_model}", f"reward_pretrain={small_model}", *outputs(tmp_path),
            f"tracker_kwargs.log_dir={tmp_path}/tb"]
    cfg = load_config(str(PG_VAR), over, cpu_host=True)
    preflight(cfg)
    assert cfg.pipeline == "agentic" and cfg.policy_loss == "topr"
    from roll_gspo.cli import main

    monkeypatch.setattr("roll_gspo.config.plan.cpu_run.cpu_only_host", lambda: True)
    capsys.readouterr()
    assert main(["--config", str(PG_VAR), "--dry-run", *over]) == 0
    out = capsys.readouterr().out
    assert "policy loss: topr" in out and "agentic pipeline" in out
