"""The run plan (roll_gspo.config.plan.run_plan): what a run decided, recorded once and frozen; the config
read-only once frozen (roll_gspo.schema.frozen); `--dry-run` prints the plan."""
import copy
import dataclasses
import pickle

import pytest

from roll_gspo.config import load_config
from roll_gspo.config.load.loader import config_to_yaml
from roll_gspo.config.plan.run_plan import (REFERENCE_ADAPTER_OFF, REFERENCE_NONE, REFERENCE_ROLE, build_run_plan,
                                   freeze_config)
from roll_gspo.schema import ReadOnlyConfigError, is_frozen, replaced, thawed


def test_the_rlvr_example_plan():
    plan = build_run_plan(load_config("example_gspo.yaml"))
    assert plan.pipeline == "rlvr" and not plan.critic and plan.reference == REFERENCE_NONE
    assert [r.name for r in plan.roles] == ["actor_train", "actor_infer", "rewards.math_rule"]
    train = plan.role("actor_train")
    assert (train.world_size, train.strategy, train.device_mapping, train.gpus_per_worker) == (
        2, "deepspeed_train", None, 0.0)
    assert not plan.offload_between_phases and plan.sleep_level is None
    assert plan.old_logprobs.source == "rollout" and plan.weight_sync_transport == "auto"
    assert len(plan.weight_routes) == 1 and "actor_infer rank 0 <- shared memory" in plan.weight_routes[0]
    assert plan.policy_parameters and plan.policy_parameters < 10_000_000  # the built-in tiny model, not built
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pipeline = "sft"
    with pytest.raises(KeyError, match="no role 'critic'"):
        plan.role("critic")


def _role_names(plan):
    return {role.name for role in plan.roles}


def test_ppo_plans_a_critic_and_lora_scores_the_reference_with_its_adapter_off():
    ppo = build_run_plan(load_config("example_ppo.yaml"))
    assert ppo.critic and "critic" in _role_names(ppo)
    lora = build_run_plan(load_config("example_gspo_lora.yaml"))
    assert lora.reference == (REFERENCE_ADAPTER_OFF if load_config("example_gspo_lora.yaml").needs_reference_log_probs()
                              else REFERENCE_NONE)
    assert "reference" not in _role_names(lora)
    kl = build_run_plan(load_config("example_gspo.yaml", ["use_kl_loss=true"]))
    assert kl.reference == REFERENCE_ROLE and "reference" in _role_names(kl)
    kl_lora = build_run_plan(load_config("example_gspo_lora.yaml", ["use_kl_loss=true"]))
    assert kl_lora.reference == REFERENCE_ADAPTER_OFF and "reference" not in _role_names(kl_lora)


def test_the_agentic_plan_has_no_reward_roles():
    plan = build_run_plan(load_config("example_agentic.yaml"))
    assert plan.pipeline == "agentic" and not any(r.name.startswith("rewards.") for r in plan.roles)
    assert plan.old_logprobs is not None


def test_a_colocated_gpu_plan_offloads_and_sleeps():
    cfg = load_config("configs/gpu/qwen2.5-0.5b_1gpu.yaml", cpu_host=False)  # every role on GPU 0
    plan = build_run_plan(cfg)
    assert plan.offload_between_phases and plan.sleep_level in (1, 2) and "actor_train" in plan.colocated_with
    assert plan.role("actor_infer").device_mapping == (0,) and plan.role("actor_train").on_gpu
    assert any("CUDA IPC" in line for line in plan.weight_routes)  # same GPU as the trainer
    assert "offload between phases: on" in plan.text()


def test_the_plan_follows_the_old_logprob_rule():
    token_bf16 = ["importance_sampling=token", "actor_infer.model_args.dtype=bf16",  # fp32 token ratios: vLLM's
                  "actor_infer.strategy_args.strategy_config.dtype=bfloat16"]
    plan = build_run_plan(load_config("example_gspo.yaml", token_bf16))
    assert plan.old_logprobs.source == "trainer" and "importance_sampling: token" in plan.old_logprobs.reason
    assert build_run_plan(load_config("example_gspo.yaml"), model_is_moe=True).old_logprobs.source == "trainer"


def test_a_frozen_config_refuses_writes_naming_the_key():
    cfg = freeze_config(load_config("example_gspo.yaml"))
    assert is_frozen(cfg) and is_frozen(cfg.actor_train.model_args)
    with pytest.raises(ReadOnlyConfigError, match=r"^actor_train\.model_args\.dtype: the config is read-only"):
        cfg.actor_train.model_args.dtype = "bf16"
    with pytest.raises(ReadOnlyConfigError, match=r"^max_steps: "):
        cfg.max_steps = 3
    with pytest.raises(ReadOnlyConfigError, match=r"^rewards\.math_rule\.world_size: "):
        cfg.rewards["math_rule"].world_size = 2
    with pytest.raises(ReadOnlyConfigError, match=r"^rewards\.extra: "):
        cfg.rewards["extra"] = cfg.rewards["math_rule"]
    with pytest.raises(ReadOnlyConfigError, match=r"^actor_infer\.strategy_args\.strategy_config\.x: "):
        cfg.actor_infer.strategy_args.strategy_config["x"] = 1
    with pytest.raises(ReadOnlyConfigError, match=r"^actor_train\.system_envs"):
        cfg.actor_train.system_envs.update({"A": "1"})


def test_freezing_changes_nothing_a_config_shows_and_survives_pickling():
    loaded = load_config("example_gspo_multidomain.yaml")
    before, yaml_before = repr(loaded), config_to_yaml(loaded)
    cfg = freeze_config(loaded)
    assert repr(cfg) == before and config_to_yaml(cfg) == yaml_before
    assert dataclasses.asdict(cfg) == dataclasses.asdict(thawed(cfg))
    for copied in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):  # Ray pickles it to the workers
        assert copied == cfg and is_frozen(copied) and repr(copied) == before
        with pytest.raises(ReadOnlyConfigError):
            copied.actor_infer.world_size = 3
    writable = thawed(cfg)
    writable.max_steps = 7
    writable.actor_infer.strategy_args.strategy_config["x"] = 1
    assert cfg.max_steps != 7 and "x" not in cfg.actor_infer.strategy_args.strategy_config


def test_replaced_makes_a_frozen_copy_with_keys_changed():
    cfg = freeze_config(load_config("example_gspo.yaml"))
    out = replaced(cfg, {"actor_train.model_args.model_name_or_path": "/models/x", "rewards.math_rule.world_size": 3})
    assert is_frozen(out) and out.actor_train.model_args.model_name_or_path == "/models/x"
    assert out.rewards["math_rule"].world_size == 3 and cfg.rewards["math_rule"].world_size != 3
    with pytest.raises(AttributeError, match="no_such_key"):
        replaced(cfg, {"actor_train.no_such_key": 1})


def test_a_config_is_writable_until_frozen():
    cfg = load_config("example_gspo.yaml")  # freezing is the caller's step (freeze_config), after preflight
    cfg.max_steps = 3
    assert not is_frozen(cfg)


def test_dry_run_prints_the_plan(capsys):
    from roll_gspo.cli import main

    assert main(["--config", "example_gspo_lora.yaml", "--dry-run", "use_kl_loss=true"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run plan: rlvr pipeline\n")
    assert "  actor_train: " in out and "reference log-probs: actor_train with its LoRA adapter disabled" in out
    assert "old log-probs: " in out and "placement plan:" in out


def test_the_schema_imports_nothing_above_it():
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "roll_gspo" / "schema"
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("roll_gspo.") or name.startswith(("roll_gspo.schema", "roll_gspo.catalog")), (
                    f"{path.name} imports {name}")
